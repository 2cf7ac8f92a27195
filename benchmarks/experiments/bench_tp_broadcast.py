"""What making TP rank 0 authoritative costs per step: broadcasting its sampled tokens against
broadcasting the proposal probabilities q (docs/architecture.md, "Tensor and pipeline parallelism").

Two CPU processes, one core each, over the same gloo group type vLLM's CPU backend falls back to
(`torch.distributed.broadcast`, as `GroupCoordinator.broadcast` calls it):
- tokens: `[rows, K+1]` int32 (what `patches/tp_sampling.py` sends);
- q: `[rows * K, vocab]` float32 (what every rank would need to verify with q itself).

    python benchmarks/experiments/bench_tp_broadcast.py            # prints one JSON line per case
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

K = 5
CASES = [("tokens", rows, None) for rows in (1, 16, 64)] + \
        [("q", rows, vocab) for vocab in (128256, 151936) for rows in (1, 16)]


def _worker(rank: int, port: int, repeats: int, queue) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for kind, rows, vocab in CASES:
        t = (torch.zeros(rows, K + 1, dtype=torch.int32) if kind == "tokens"
             else torch.zeros(rows * K, vocab, dtype=torch.float32))
        for _ in range(3):
            dist.broadcast(t, src=0)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.broadcast(t, src=0)
        dist.barrier()
        ms = (time.perf_counter() - start) / repeats * 1e3
        if rank == 1:
            queue.put({"payload": kind, "rows": rows, "K": K, "vocab": vocab,
                       "bytes": t.numel() * t.element_size(), "ms_per_step": round(ms, 3)})
    dist.destroy_process_group()


def main(repeats: int = 20) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_worker, args=(r, port, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in CASES]
    for p in procs:
        p.join()
    return results


if __name__ == "__main__":
    for row in main(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        print(json.dumps(row))
