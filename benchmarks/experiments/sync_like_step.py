"""An SSD drafter drafting as `sync` does (its pre-draft switch held in the fallback) against the
`SyncDrafter`, step by step in one process: what a round drafted as `sync` costs beyond `sync` itself.

Every row misses and is drafted K tokens just in time, as in `sync`. Three drafters, alternated twice:
`sync`; `ssd-as-sync` (the switch in the fallback, draft logits kept only where a pre-draft is expected:
`PreDraftSwitch.predraft_expected`); `ssd-as-sync-keep` (every step keeps its draft logits for a glue,
the behaviour before that rule). Prints the median wall and CPU milliseconds per step (CPU time is the
figure to read on a shared machine).

    .venv/bin/python benchmarks/experiments/sync_like_step.py MODEL_DIR --batch 64 --temperature 1 --steps 8

MODEL_DIR: a draft model directory, e.g. `benchmarks/regimes.py`'s ratio-1 128k draft
(~/.cache/saguaro-vllm/regimes/v128256/draft).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
from saguaro_vllm.drafter.sync_drafter import SyncDrafter
from saguaro_vllm.shared.proposal_buffers import ProposalRing
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

K = 5
KINDS = ("sync", "ssd-as-sync", "ssd-as-sync-keep")


def make(kind: str, model, vocab: int, batch: int):
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=4096, block_size=16))
    if kind == "sync":
        drafter = SyncDrafter(runner, vocab_size=vocab)
    else:
        drafter = SSDDrafter(runner, vocab_size=vocab, options={})
        switch = drafter.planner.switch
        switch.predrafting = False  # in the fallback: every round drafts as `sync` does
        switch.decide = lambda *a, **k: False
        if kind == "ssd-as-sync-keep":
            switch.predraft_expected = lambda: True
    drafter.probs_ring = ProposalRing.create(rows=batch, k=K, vocab=vocab)
    return drafter


def measure(kind: str, model, vocab: int, batch: int, temperature: float, steps: int, rng) -> tuple[float, float]:
    drafter = make(kind, model, vocab, batch)
    spec = SamplingSpec() if temperature == 0 else SamplingSpec(temperature=temperature, seed=1)
    ctx = {f"r{i}": rng.integers(2, vocab - 2, 12).tolist() for i in range(batch)}
    resp = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, K, spec) for r, c in ctx.items()], []))
    wall, cpu = [], []
    for s in range(steps):
        drafter.probs_ring.release_held()
        if isinstance(drafter, SSDDrafter):
            drafter.answered()
            while drafter.busy:
                drafter.advance()
        rows = []
        for j, (rid, c) in enumerate(ctx.items()):  # every draft accepted, a random bonus: every row misses
            bonus = int(rng.integers(2, vocab - 2))
            rows.append(RowUpdate(rid, len(c), resp.drafts[j] + [bonus], K))
            ctx[rid] = c + resp.drafts[j] + [bonus]
        t0, c0 = time.perf_counter(), time.process_time()
        resp = drafter.step(StepRequest(s + 2, rows, []))
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if isinstance(drafter, SSDDrafter):
            assert set(resp.row_status) == {"jit"}, resp.row_status  # drafted as `sync` does
    drafter.probs_ring.close()
    return 1e3 * float(np.median(wall[2:])), 1e3 * float(np.median(cpu[2:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = load_draft_model(args.model, dtype=torch.float32, device="cpu")
    rng = np.random.default_rng(0)
    out: dict[str, list] = {}
    for kind in KINDS * 2:
        out.setdefault(kind, []).append([round(x, 1) for x in measure(kind, model, model.config.vocab_size,
                                                                       args.batch, args.temperature, args.steps, rng)])
    print(json.dumps({"batch": args.batch, "temperature": args.temperature, "wall_ms_cpu_ms": out}))


if __name__ == "__main__":
    main()
