"""Times one drafter forward as the SSD pre-draft runs it: N branches forked from one request, one new token
each, per matmul path of the draft's linear layers (`saguaro.linear`) and prefix length.

Usage: python benchmarks/experiments/bench_draft_step.py [--draft DIR] [--core 1] [--prefix 200,1000] [--rows 1,6,13,24]
Default draft: the demo pair's cost-matched draft (built by `saguaro-vllm make-demo-pair`).
Results: benchmarks/results/experiments/<date>-draft-step.json and a table on stdout (median ms per forward).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for bench_ops
from bench_ops import save_results  # noqa: E402


def step_ms(runner, prefix: int, rows: int, reps: int) -> float:
    """Median ms of one forward over `rows` branches forked at `prefix` (`saguaro-vllm calibrate` times the
    draft forward with the same function)."""
    from saguaro_vllm.projection.calibrate import step_s

    return step_s(runner, prefix, rows, reps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", help="draft model directory (default: the demo pair's cost-matched draft)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--linear", default="plain,packed,int8")
    ap.add_argument("--prefix", default="200,1000")
    ap.add_argument("--rows", default="1,6,13,24")
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1, help="the core to pin to (-1: none)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "experiments")
    args = ap.parse_args()
    if args.core >= 0:
        from saguaro_vllm.shared.placement import pin_process

        pin_process([args.core])
    from saguaro_vllm.drafter.kv_cache import KVCacheConfig
    from saguaro_vllm.drafter.model.linear_kernels import install_linear_kernel, resolve_linear
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner

    draft = args.draft
    if draft is None:
        from saguaro_vllm.demo.build import ensure_demo_pair

        draft = str(ensure_demo_pair(cost_matched=True).draft_cost)
    prefixes = [int(p) for p in args.prefix.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for kind in tqdm(args.linear.split(","), desc="linear paths"):
        resolve_linear(kind, "cpu", args.dtype)  # a clear error if this path cannot run here
        model = load_draft_model(draft, dtype=args.dtype)
        install_linear_kernel(model, kind)
        runner = DraftModelRunner(model, KVCacheConfig(num_blocks=4 * max(prefixes), block_size=16))
        for prefix in prefixes:
            runner.add_request("parent")
            runner.forward([("parent", [5 + i % 97 for i in range(prefix)], 0)], max_tokens_per_seq=prefix)
            for rows in rows_list:
                results.append(dict(linear=kind, dtype=args.dtype, prefix=prefix, rows=rows,
                                    ms=step_ms(runner, prefix, rows, args.reps)))
            runner.free_request("parent")
    print(f"\nms per forward, {args.dtype}, {Path(draft).name}, pinned to core {args.core}")
    print(f"{'linear':>8} {'prefix':>6} " + " ".join(f"{r:>6d}" for r in rows_list) + "  (rows)")
    for kind in args.linear.split(","):
        for prefix in prefixes:
            cells = [r["ms"] for r in results if r["linear"] == kind and r["prefix"] == prefix]
            print(f"{kind:>8} {prefix:>6} " + " ".join(f"{c:6.1f}" for c in cells))
    save_results(args.out, "draft-step", results, draft=draft, core=args.core)

if __name__ == "__main__":
    main()
