#!/usr/bin/env bash
# The one-command GPU check of the saguaro ops (issue 5). Needs: one CUDA GPU, torch with CUDA, nvcc, pytest.
# No vLLM and no internet. Builds the CUDA ops, runs the op tests on CUDA (and CPU), times one drafter round
# on a random Llama-3.2-1B-shaped draft with the ops and with the references. Target: under 8 minutes.
#
#   bash benchmarks/device_check.sh            # writes logs and JSON to $OUT (or benchmarks/results/)
#
# If pytest/filelock are missing and a wheel folder `.whl/` was carried along, they are installed from it.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
out="${OUT:-$root/benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export SAGUARO_OPS=compiled
export SAGUARO_OPS_CACHE="${SAGUARO_OPS_CACHE:-/tmp/saguaro-ops-cache}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-8}"
status=0
t_start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - t_start )) s)"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nvcc --version | tail -n1
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
if ! "$py" -c "import pytest" 2>/dev/null && [[ -d .whl ]]; then
    "$py" -m pip install -q --no-index --find-links .whl pytest filelock || true
fi

step "build the ops (CPU + CUDA) into $SAGUARO_OPS_CACHE"
"$py" - <<'PY' 2>&1 | tee "$out/device-build.log" || status=1
import torch
from saguaro_vllm.ops import loader
st = loader.status()
print(st)
assert loader.implementation("cuda") == "cuda", st.error
print("cpu isa:", torch.ops.saguaro.cpu_isa())
PY

step "nvcc -std=c++17 -arch=sm_90 -c on each .cu file"
for f in csrc/cuda/*.cu; do
    nvcc -std=c++17 -arch=sm_90 -c "$f" -o /tmp/"$(basename "$f")".o && echo "ok $f" || status=1
done

step "op tests (CPU and CUDA)"
timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/test_ops_branch_attention.py tests/test_ops_candidates.py \
    tests/test_ops_proposal.py tests/test_ops_build.py 2>&1 | tee "$out/device-tests.log" | tail -n 25
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

step "Triton branch attention vs the CUDA op and the reference (bf16, batch 16 x 24 branches, prefix 1000)"
timeout 120 "$py" - <<'PY' 2>&1 | tee "$out/device-triton.log" || status=1
import sys, time, torch
sys.path.insert(0, "tests")
from test_ops_branch_attention import make_case
from saguaro_vllm.ops import branch_attention, reference
from saguaro_vllm.ops.triton_attention import branch_attention as triton_attention
args = make_case(16, 24, [1000, 257], 16, 5, 32, 8, 64, torch.bfloat16, "cuda", seed=0)
ref = reference.branch_attention(**args).float()
for name, fn in (("cuda op", branch_attention), ("triton", triton_attention)):
    out = fn(**args).float()
    err = ((out - ref).abs() / (1 + ref.abs())).max().item()
    for _ in range(3):
        fn(**args)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20):
        fn(**args)
    torch.cuda.synchronize()
    print(f"{name}: {1e3 * (time.perf_counter() - t) / 20:.3f} ms per call, max rel err {err:.2e}")
    assert err < 2e-2, name
PY

step "device proposal ring: CUDA IPC slots written by a second process (issue 26 item 3)"
timeout 120 "$py" benchmarks/check_device_ring.py --rows 64 --k 5 --vocab 128256 --out "$out/device-ring.json" \
    2>&1 | tee "$out/device-ring.log" || status=1

step "drafter round on a random Llama-3.2-1B-shaped draft (bf16, CUDA)"
timeout 240 "$py" benchmarks/bench_ops.py --round llama-3.2-1b --device cuda --dtype bfloat16 \
    --temperature 0.8 --reps 5 --out "$out" 2>&1 | tee "$out/device-round.log" || status=1

step "done: status $status"
exit $status
