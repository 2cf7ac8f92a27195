"""The per-step cost of the link between vLLM's output worker and its drafter, in each layout this machine can run.

A layout adds to every step only what the worker and the drafter exchange: one `StepRequest` out, one
`StepResponse` back, over the PAIR socket (`shared/transport.py`), encoded and checked as in serving. This
measures that round trip with a drafter that does no work (it answers K fixed drafts per row at once), so the
time is the link's own: the local layout (one worker, one drafter) and data parallelism (D worker/drafter pairs
at once, one per DP rank, each pair a process pair of its own as vLLM's engines are). Under vLLM's Ray executor
the link is the same local socket on the output worker's node (Ray only reserves the drafter's GPU at start),
so its cost is the local one.

    python benchmarks/bench_layout_link.py --batches 1,16,64 --pairs 1,2 --steps 400
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from saguaro_vllm.shared.transport import (  # noqa: E402
    Channel,
    RowUpdate,
    Shutdown,
    StepRequest,
    StepResponse,
    ToDrafter,
    ToProposer,
    check_response,
    new_endpoint,
)

K = 5
VOCAB = 128256


def drafter(endpoint: str, core: int | None) -> None:
    """Answers every step at once: K drafts per row, greedy (no probabilities), as a sync drafter's reply."""
    import os

    if core is not None:
        os.sched_setaffinity(0, {core})
    chan = Channel(endpoint, bind=False, accepts=ToDrafter)
    while True:
        msg = chan.recv()
        if isinstance(msg, Shutdown):
            break
        drafts = [[7] * r.num_drafts for r in msg.rows]
        chan.send(StepResponse(msg.step, drafts, {}, 0.0, row_status=["drafted"] * len(drafts),
                               row_depth=[-1] * len(drafts)), wait_s=1.0)
    chan.close()


def worker(batch: int, steps: int, core: int | None, out: mp.Queue) -> None:
    """One engine's output worker: `steps` steps of `batch` rows (one new token each), timed round trips."""
    import os

    if core is not None:
        os.sched_setaffinity(0, {core})
    endpoint = new_endpoint()
    chan = Channel(endpoint, bind=True, accepts=ToProposer)
    peer = mp.get_context("spawn").Process(target=drafter, args=(endpoint, core))
    peer.start()
    rows0 = [RowUpdate(f"req-{i}", 0, list(range(1, 33)), K) for i in range(batch)]
    times = []
    for step in range(1, steps + 1):
        rows = rows0 if step == 1 else [RowUpdate(f"req-{i}", 31 + step, [5], K) for i in range(batch)]
        req = StepRequest(step, rows, [], sent_at=time.monotonic())
        t0 = time.perf_counter()
        chan.send(req, wait_s=5.0)
        resp = chan.recv(timeout_s=10.0)
        assert check_response(req, resp, VOCAB) is None
        times.append(time.perf_counter() - t0)
    chan.send(Shutdown(), wait_s=1.0)
    peer.join(10)
    chan.close()
    out.put(times[20:])  # the first steps connect and warm up


def run(batch: int, pairs: int, steps: int, pin: bool) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    cores = sorted(__import__("os").sched_getaffinity(0))
    procs = [ctx.Process(target=worker, args=(batch, steps, cores[i % len(cores)] if pin else None, out))
             for i in range(pairs)]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    all_times = sorted(t for ts in results for t in ts)
    return {"batch": batch, "pairs": pairs, "steps": len(all_times),
            "median_ms": 1e3 * statistics.median(all_times),
            "p99_ms": 1e3 * all_times[int(0.99 * (len(all_times) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--pairs", default="1,2", help="worker/drafter pairs at once (DP ranks)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--pin", action="store_true", help="pair i on core i (a DP rank's own core)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [run(b, p, args.steps, args.pin) for p in map(int, args.pairs.split(","))
            for b in map(int, args.batches.split(","))]
    for r in rows:
        print(f"pairs {r['pairs']} batch {r['batch']:>3}: median {r['median_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms "
              f"({r['steps']} steps)")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
