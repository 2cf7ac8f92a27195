"""Host time of one one-token drafter forward (`DraftModelRunner.forward`, every row feeding one token), the
dynamic path against the static bucketed one (drafter/static_forward.py), with a compute-free draft (1 layer,
hidden 16, vocabulary 256): what is measured is the host's work per forward (chunks, block tables, slots,
metadata, launches), on CPU, without CUDA graphs (those need a GPU; there the static path replays one graph
instead of launching every kernel).

Rows: batch 1, 16, 64 (decode / jit steps), and 2048 (a branch step at batch 64 x 32 branches, forks of 64
parents sharing their prefix blocks). Contexts of 100..164 tokens. Median and minimum over repeats.

    .venv/bin/python benchmarks/experiments/bench_static_forward.py                     # this tree
    .venv/bin/python benchmarks/experiments/bench_static_forward.py --tree /tmp/before  # another tree (dynamic only)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("SAGUARO_CACHE", Path.home() / ".cache" / "saguaro-vllm")) / "bench-host"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", default=str(ROOT), help="source tree whose saguaro_vllm is measured")
    parser.add_argument("--rows", default="1,16,64,2048")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    sys.path.insert(0, args.tree)
    sys.path.insert(1, str(ROOT / "tests"))
    import numpy as np
    import torch
    from distribution import build_tiny_llama

    from saguaro_vllm.drafter.kv_cache import KVCacheConfig
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner

    torch.set_num_threads(1)
    path = CACHE / "llama-h16-l1-v256"
    if not (path / "model.safetensors").exists():
        build_tiny_llama(path, vocab_size=256, num_layers=1, hidden_size=16, num_heads=1)
    model = load_draft_model(path, dtype=torch.float32, device="cpu")
    static_ok = "static_buckets" in DraftModelRunner.__init__.__code__.co_varnames
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        row = {"rows": rows}
        for mode in ("dynamic", "static") if static_ok else ("dynamic",):
            kw = {"static_buckets": (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)} if mode == "static" else {}
            runner = DraftModelRunner(model, KVCacheConfig(num_blocks=32768, block_size=16), **kw)
            rng = np.random.default_rng(0)
            parents = min(rows, 64)
            for p in range(parents):
                runner.add_request(f"p{p}")
                runner.forward([(f"p{p}", rng.integers(1, 256, 100 + p).tolist(), 0)])
            ids = [f"p{p}" for p in range(parents)]
            for f in range(rows - parents):
                parent = ids[f % parents]
                runner.fork(parent, f"f{f}", runner.num_computed(parent))
                ids.append(f"f{f}")
            base = {i: runner.num_computed(i) for i in ids}
            times = []
            for rep in range(args.repeats + 3):
                chunks = [(i, [7], base[i]) for i in ids]
                t0 = time.perf_counter()
                runner.forward(chunks)
                elapsed = time.perf_counter() - t0
                if rep >= 3:  # the first forwards of a shape warm caches (and allocate the forks' new blocks)
                    times.append(elapsed)
                for i in ids:
                    runner.truncate(i, base[i])
            if mode == "static":
                assert runner.static.runs, "the static path did not run"
            row[mode] = {"median_ms": round(1e3 * statistics.median(times), 3),
                         "min_ms": round(1e3 * min(times), 3)}
        results.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
