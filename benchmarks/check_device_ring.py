"""GPU check of the device proposal ring (`saguaro.proposal_transport: "device"`), without vLLM.

The parent plays the proposer: it creates the ring on `--target` (slots in that GPU's memory, a CUDA IPC
handle in the spec, the header in shared host memory). A spawned child plays the drafter: it attaches from
the JSON spec alone, computes q' on `--draft` (another GPU if there is one), writes it into a slot with the
drafter's batched per-position write, and publishes. The parent then checks, on the target GPU, that the
slot holds exactly the child's floats, builds one-hot rows for greedy rows there (`assemble`), and times the
child's writes. Prints one JSON line and writes it to --out.

    python benchmarks/check_device_ring.py --rows 64 --k 5 --vocab 128256 --out /tmp/ring.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from saguaro_vllm.shared.proposal_buffers import ProposalRing, SlotWriter, assemble, transport_for  # noqa: E402


def drafter(spec: dict, draft_device: str, seed: int, batch: int, result: mp.Queue) -> None:
    try:
        ring = ProposalRing.attach(spec)
        gen = torch.Generator(device=draft_device).manual_seed(seed)
        q = torch.rand(ring.k, batch, ring.vocab, generator=gen, device=draft_device).softmax(-1)
        writer = SlotWriter(ring, seq=7)
        torch.cuda.synchronize(draft_device)
        t0 = time.perf_counter()
        for pos in range(ring.k):  # the K-step loop's writes: one batched write per draft position
            writer.put_positions(list(range(batch)), [pos] * batch, q[pos])
        slot, rows = writer.finish()  # publish: synchronises the copies before the slot is HELD
        result.put({"slot": slot, "rows": rows, "write_ms": 1e3 * (time.perf_counter() - t0),
                    "checksum": float(q.double().sum())})
    except Exception as err:  # noqa: BLE001 - report to the parent
        result.put({"error": f"{type(err).__name__}: {err}"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--target", default="cuda:0")
    p.add_argument("--draft", default="auto", help="the drafter's GPU (auto: the last visible one)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    out = {"check": "device-ring", "rows": a.rows, "k": a.k, "vocab": a.vocab}
    if not torch.cuda.is_available():
        out["skipped"] = "no CUDA device"
        print(json.dumps(out))
        return 0
    draft = a.draft if a.draft != "auto" else f"cuda:{torch.cuda.device_count() - 1}"
    out.update(target=a.target, draft=draft, transport=transport_for(a.target, draft))
    ring = ProposalRing.create(rows=a.rows, k=a.k, vocab=a.vocab, device=a.target)
    batch = a.rows // 2  # the other half: greedy rows' one-hot rows
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    child = ctx.Process(target=drafter, args=(json.loads(json.dumps(ring.spec())), draft, 0, batch, result))
    child.start()
    got = result.get(timeout=300)
    child.join(timeout=60)
    out.update(got)
    ok = "error" not in got and ring.held(got["slot"], 7)
    if ok:
        gen = torch.Generator(device=draft).manual_seed(0)
        want = torch.rand(a.k, batch, a.vocab, generator=gen, device=draft).softmax(-1).to(a.target)
        buf = ring.slot(got["slot"])
        exact = bool(torch.equal(buf[:batch].transpose(0, 1), want))
        greedy = [[int(t) for t in torch.randint(0, a.vocab, (a.k,))] for _ in range(a.rows - batch)]
        drafts = [[0] * a.k] * batch + greedy
        probs, order = assemble(buf, list(range(batch)), drafts, a.k)
        one_hot = bool((probs[batch:].sum(-1) == 1).all()) and probs.device == torch.device(a.target)
        out.update(exact=exact, one_hot_on_target=one_hot, proposal_device=str(probs.device))
        ok = exact and one_hot
    out["ok"] = ok
    ring.close()
    line = json.dumps(out)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
