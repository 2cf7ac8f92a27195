"""What sampled rows' probabilities cost on a remote drafter's link (docs/layouts.md).

A local drafter hands q to the worker through shared memory; a remote one sends float32 [drafts, vocab] per
sampled row in every reply. This times one step's exchange as the remote drafter and its worker do it: a
StepRequest over the socket, the drafter's reply with `rows` arrays of [k, vocab] (views of its ring slot,
sent without copying), the worker's size and content checks (`transport.check_response`) and its copy into
the proposer's ring (`RemoteDrafterClient._land`). Links: `tcp` (127.0.0.1, CurveZMQ as in production) and
`ipc` (no encryption: the local drafter's socket, as a floor). The drafter side runs in its own process.

    python benchmarks/remote_probs.py [--rows 16 --k 6 --vocab 128256 --steps 30 --out benchmarks/results/...]
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from saguaro_vllm.shared.proposal_buffers import ProposalRing  # noqa: E402
from saguaro_vllm.shared.secret import curve_keys  # noqa: E402
from saguaro_vllm.shared.transport import (Channel, RowUpdate, SamplingSpec, Shutdown, StepRequest,  # noqa: E402
                                           StepResponse, ToProposer, ToRemoteDrafter, check_response,
                                           reply_size_limit)

SECRET = b"benchmark-secret-0123456789abcdef"


def _request(step: int, rows: int, k: int) -> StepRequest:
    return StepRequest(step, [RowUpdate(f"r{i}", 100, [7], k, SamplingSpec(temperature=1.0)) for i in range(rows)],
                       [], sent_at=time.monotonic())


def _drafter(endpoint: str, rows: int, k: int, vocab: int) -> None:
    """The drafter's side: q in a private ring slot, replies carrying views of it (remote_server.inline_probs)."""
    from saguaro_vllm.drafter.remote_server import _authenticator, inline_probs

    remote = endpoint.startswith("tcp")
    keys = curve_keys(SECRET, server=True)
    chan = Channel(endpoint, bind=True, accepts=ToRemoteDrafter, curve=keys if remote else None)
    auth = _authenticator(chan.ctx, keys.peer_public) if remote else None
    ring = ProposalRing.create(rows, k, vocab)
    rng = np.random.default_rng(0)
    q = rng.random((rows, k, vocab), dtype=np.float32)
    q /= q.sum(-1, keepdims=True)
    ring.slot(0).numpy()[:] = q
    drafts = [[int(t) for t in q[r].argmax(-1)] for r in range(rows)]
    try:
        while True:
            msg = chan.recv()
            if isinstance(msg, Shutdown):
                return
            ring.header[0] = (2, msg.step)  # HELD: as the drafting code leaves a published slot
            resp = StepResponse(msg.step, drafts, {}, 0.0, probs_slot=0, probs_rows=list(range(rows)))
            inline_probs(resp, ring)
            tracker = chan.send(resp, wait_s=5, track=True)
            tracker.wait()
    finally:
        if auth is not None:
            auth.stop()
        chan.close()
        ring.close()


def measure(link: str, rows: int, k: int, vocab: int, steps: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="saguaro-bench-")
    endpoint = "tcp://127.0.0.1:57311" if link == "tcp" else f"ipc://{tmp}/s"
    proc = mp.get_context("spawn").Process(target=_drafter, args=(endpoint, rows, k, vocab), daemon=True)
    proc.start()
    chan = Channel(endpoint, bind=False, accepts=ToProposer,
                   curve=curve_keys(SECRET, server=False) if link == "tcp" else None)
    ring = ProposalRing.create(rows, k, vocab)
    round_trip, check, land, nbytes = [], [], [], 0
    try:
        time.sleep(1.0)
        for step in range(1, steps + 3):
            req = _request(step, rows, k)
            limit, frames_limit = reply_size_limit(req, vocab)
            t0 = time.perf_counter()
            assert chan.send(req, wait_s=10)
            frames = chan.sock.recv_multipart(copy=False)
            t1 = time.perf_counter()
            resp = chan.codec.decode(frames)
            assert sum(f.buffer.nbytes for f in frames) <= limit and len(frames) <= frames_limit
            problem = check_response(req, resp, vocab)
            t2 = time.perf_counter()
            assert problem is None, problem
            slot = ring.acquire(step)
            buf = ring.slot(slot).numpy()
            for r, j in enumerate(resp.probs):
                np.copyto(buf[r, : resp.probs[j].shape[0]], resp.probs[j])
            ring.release_held()
            ring.abandon(slot)
            t3 = time.perf_counter()
            if step > 2:  # the first steps fault in the ring's pages
                round_trip.append(t1 - t0)
                check.append(t2 - t1)
                land.append(t3 - t2)
                nbytes = sum(f.buffer.nbytes for f in frames)
        chan.send(Shutdown(), wait_s=5)
    finally:
        proc.join(10)
        chan.close()
        ring.close()

    def ms(xs: list[float]) -> dict:
        return {"median_ms": round(1e3 * statistics.median(xs), 3), "p90_ms": round(1e3 * sorted(xs)[int(0.9 * len(xs))], 3)}

    return {"link": link, "reply_bytes": nbytes, "round_trip": ms(round_trip), "check": ms(check),
            "land": ms(land), "total_median_ms": round(1e3 * statistics.median(
                [a + b + c for a, b, c in zip(round_trip, check, land)]), 3),
            "gbit_per_s": round(8 * nbytes / statistics.median(round_trip) / 1e9, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=f"benchmarks/results/{datetime.date.today()}-remote-probs.json")
    args = p.parse_args()
    results = [measure(link, args.rows, args.k, args.vocab, args.steps) for link in ("ipc", "tcp")]
    payload = args.rows * args.k * args.vocab * 4
    out = {"benchmark": "remote_probs", "date": str(datetime.date.today()),
           "settings": {"rows": args.rows, "k": args.k, "vocab": args.vocab, "steps": args.steps,
                        "q_bytes_per_step": payload},
           "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
           "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"{args.rows} sampled rows x {args.k} drafts x vocab {args.vocab} float32: q = {payload / 2**20:.1f} MiB "
          "per step")
    for r in results:
        print(f"{r['link']:>4}: reply {r['reply_bytes'] / 2**20:.1f} MiB, round trip {r['round_trip']['median_ms']} ms "
              f"(p90 {r['round_trip']['p90_ms']}, {r['gbit_per_s']} Gbit/s), checks {r['check']['median_ms']} ms, "
              f"copy into the ring {r['land']['median_ms']} ms: {r['total_median_ms']} ms per step")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
