"""Device-to-host transfers per drafter forward (issue 28: one host sync per forward). Counted on CPU with
`sync_count.CountTransfers`, over `mode: async` rounds at batch 1, 16 and 64 with a 32-branch budget, greedy
and sampled: pre-drafting (glue, then branch steps), answers that hit, and answers that draft misses just in
time. Before this bound, a branch step cost one `int()` per branch (2560 per pre-draft at batch 16 x 32)
and every sampled proposal call two `bool()`s."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

from sync_count import CountTransfers
from test_sync_drafter import make_ring

K = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def _count_forwards(drafter: SSDDrafter) -> list[int]:
    """Counts the runner's forwards: `forward` and `forward_batch` (branch steps)."""
    calls = [0]
    for name in ("forward", "forward_batch"):
        def counted(*a, _forward=getattr(drafter.runner, name), **kw):
            calls[0] += 1
            return _forward(*a, **kw)

        setattr(drafter.runner, name, counted)
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_transfers_per_forward_are_bounded(draft_model, batch, temperature):
    rng = np.random.default_rng(batch)
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=8192, block_size=16))
    drafter = SSDDrafter(runner, vocab_size=draft_model.config.vocab_size,
                         options={"backup": "jit", "fanout_budget": 32})
    drafter.probs_ring = make_ring(draft_model, rows=batch)
    spec = SamplingSpec() if temperature == 0 else SamplingSpec(temperature=temperature, seed=1)
    ctx = {f"r{i}": rng.integers(2, 300, 20).tolist() for i in range(batch)}
    first = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, K, spec) for r, c in ctx.items()], []))
    drafter.probs_ring.release_held()
    drafter.answered()
    forwards = _count_forwards(drafter)
    with CountTransfers() as pre:
        while drafter.busy:
            drafter.advance()
    assert forwards[0] == 1 + K  # glue + K branch steps over batch x 32 branches
    assert len(drafter.cache) == batch * 32
    # one transfer per branch step (every branch's token at once), two for the glue (candidates and ranks)
    assert pre.total <= forwards[0] + 1, pre.where
    assert pre.data_dependent == 0, pre.where  # no `nonzero` / boolean indexing (candidate selection had one)
    # half the rows hit (a pre-drafted outcome), half miss (a bonus token no branch has): jit drafts
    rows = []
    for j, (rid, c) in enumerate(ctx.items()):
        cached = {t for d, t in drafter.cache.outcomes(rid) if d == K}
        bonus = min(cached) if j % 2 == 0 else next(t for t in range(2, 300) if t not in cached)
        rows.append(RowUpdate(rid, len(c), first.drafts[j] + [bonus], K))
    forwards[0] = 0
    with CountTransfers() as answer:
        resp = drafter.step(StepRequest(2, rows, []))
    assert resp.row_status.count("hit") == (batch + 1) // 2 and resp.row_status.count("jit") == batch // 2
    assert forwards[0] == (K if batch > 1 else 0)
    # the jit forwards: one transfer each for the greedy argmax or the sampled draw; the hits: none
    assert answer.total <= max(forwards[0], 1) + 1, answer.where
    assert answer.data_dependent == 0
