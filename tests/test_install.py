"""The installed environment works the way the README promises (what `scripts/setup.sh` sets up)."""
from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def test_package_imports_without_vllm():
    out = subprocess.run([sys.executable, "-c", "import sys, saguaro_vllm, saguaro_vllm.config, "
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


def test_broken_torch_companions_removed():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        try:
            md.version(name)
        except md.PackageNotFoundError:
            continue
        raise AssertionError(f"{name} is installed and cannot load beside the CPU torch; rerun scripts/setup.sh")


def test_console_script():
    out = subprocess.run([str(VENV_BIN / "saguaro-vllm"), "--help"], capture_output=True, text=True, check=True)
    assert "make-demo-pair" in out.stdout
