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
    for name in ("pyproject.toml", "README.md"):
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
