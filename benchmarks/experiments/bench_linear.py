"""Times the matmul paths a CPU drafter could use for its linear layers, on this machine.

The drafter's step on CPU is dominated by its linear layers, so the issue asks which matmul path is fastest
for the row counts a multi-branch step has (1 row per sequence in a decode step, up to 24 branches per
request). Paths, all on the same random weight:

    fp32            F.linear, float32 (oneDNN/MKL sgemm)
    fp32-mkl-packed torch.ops.mkl._mkl_linear with a weight pre-packed by _mkl_reorder_linear_weight
    bf16            F.linear, bfloat16 (oneDNN; AMX or AVX512-BF16 where the CPU has them)
    bf16-packed     torch.ops.mkldnn._linear_pointwise with a weight pre-packed by _reorder_linear_weight
    int8-dynamic    quantized::linear_dynamic (fbgemm: int8 weights per output channel, activations
                    quantized per call): what `saguaro.linear: int8` uses
    int8-weight     aten::_weight_int8pack_mm (int8 weights, per-channel scales, bfloat16 activations)

Usage: python benchmarks/experiments/bench_linear.py [--threads 1] [--rows 1,6,13,24]
Results: benchmarks/results/experiments/<date>-linear.json and a table on stdout (median ms per call).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_ops
from bench_ops import save_results, timeit  # noqa: E402

from saguaro_vllm.drafter.model.linear_kernels import _int8_dynamic, int8_available  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "issue 12288x4096": (12288, 4096),
    "Llama-3.2-1B gate_up": (16384, 2048),
    "Llama-3.2-1B down": (2048, 8192),
}


def paths(w: torch.Tensor, rows: int) -> dict[str, tuple]:
    """name -> (callable(x_fp32, x_bf16), prepared state) for one weight."""
    out: dict[str, tuple] = {}
    w_bf16 = w.to(torch.bfloat16)
    out["fp32"] = lambda x, xb: F.linear(x, w)
    if torch.backends.mkl.is_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        out["fp32-mkl-packed"] = lambda x, xb: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)
    out["bf16"] = lambda x, xb: F.linear(xb, w_bf16)
    if torch.backends.mkldnn.is_available():
        packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(w_bf16, rows)
        out["bf16-packed"] = lambda x, xb: torch.ops.mkldnn._linear_pointwise(xb, packed_bf16, None, "none", [], "")
    if int8_available():
        kernel = _int8_dynamic(w, None)  # what `saguaro.linear: int8` installs (per-channel weights)
        out["int8-dynamic"] = lambda x, xb: kernel(x)
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-8)
    w_int8 = (w / scales[:, None]).round().to(torch.int8)
    scales_bf16 = scales.to(torch.bfloat16)
    out["int8-weight"] = lambda x, xb: torch._weight_int8pack_mm(xb, w_int8, scales_bf16)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="the drafter's cores (1 in the CPU split placement)")
    ap.add_argument("--rows", default="1,6,13,24")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "experiments")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    cases = [(s, r) for s in SHAPES for r in rows_list]
    for shape, rows in tqdm(cases, desc="linear cases"):
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * k**-0.5
        x = torch.randn(rows, k)
        xb = x.to(torch.bfloat16)
        ref = F.linear(x, w)
        for name, fn in paths(w, rows).items():
            y = fn(x, xb).float()
            err = ((y - ref).norm() / ref.norm()).item()
            ms = timeit(lambda fn=fn: fn(x, xb), min_time=0.3, max_reps=30) * 1e3
            results.append(dict(shape=shape, out_features=n, in_features=k, rows=rows, path=name, ms=ms,
                                rel_error=err))
    names = list(dict.fromkeys(r["path"] for r in results))
    print(f"\nmedian ms per call, {args.threads} thread(s); relative error vs fp32 in brackets")
    print(f"{'shape':22s} {'rows':>4s} " + " ".join(f"{n:>17s}" for n in names))
    for shape, rows in cases:
        cells = {r["path"]: r for r in results if r["shape"] == shape and r["rows"] == rows}
        print(f"{shape:22s} {rows:>4d} " + " ".join(
            f"{cells[n]['ms']:8.2f} [{cells[n]['rel_error']:.0e}]" if n in cells else f"{'-':>17s}" for n in names))
    save_results(args.out, "linear", results, threads=args.threads)

if __name__ == "__main__":
    main()
