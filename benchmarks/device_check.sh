#!/usr/bin/env bash
# The GPU check that says yes or no (issue 28 item 7): one prepared run, under 8 minutes on one H100/H200.
# It starts with `saguaro-vllm doctor`.
# Needs only Python 3.12, torch with CUDA, Triton and nvcc (pytest for the op tests; no vLLM, pyzmq, msgspec or
# pydantic, no internet). Builds the ops, compiles every CUDA source with nvcc, runs the op tests on CUDA, then
# SSDDrafter rounds on a random Llama-3.2-1B-shaped bf16 draft at batch 1/16/64 x budgets 8/32, without and
# with CUDA graphs; prints YES / NO / NOT RUN (and why) per part. All of it is benchmarks/device_check.py.
#
#   bash benchmarks/device_check.sh            # JSON + log to $OUT (or benchmarks/results/); exit 1 on any NO
#   bash benchmarks/device_check.sh --cpu-smoke   # the same script on tiny CPU shapes (seconds)
#
# If pytest is missing and a wheel folder `.whl/` was carried along, it is installed from there first.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export SAGUARO_OPS_CACHE="${SAGUARO_OPS_CACHE:-/tmp/saguaro-ops-cache}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-8}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
if ! "$py" -c "import pytest" 2>/dev/null && [[ -d .whl ]]; then
    "$py" -m pip install -q --no-index --no-deps --target /tmp/device-check-site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/device-check-site"
fi
# First what a user runs before serving: vLLM, torch/CUDA, GPUs, ops (one line each; informative here, where
# vLLM is usually absent, so its exit code does not stop the check).
"$py" -m saguaro_vllm.tools.cli doctor || true
# The driver keeps its own budget (450 s); this is the backstop that keeps the whole run under 8 minutes.
exec timeout 470 "$py" benchmarks/device_check.py "$@"
