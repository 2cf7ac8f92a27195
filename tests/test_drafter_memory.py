"""The drafter under memory pressure, both modes, without vLLM: a KV cache too small for every request never
raises; rows without room get no drafts (status `noroom`, one rate-limited warning), and drafts again once
others are freed; a context larger than the whole cache goes unspeculated with one warning; in `async`,
pre-drafted branches are dropped before any request's own KV. Every draft that is sent is still exactly the
draft model's continuation of the committed context."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
from saguaro_vllm.drafter.sync_drafter import SyncDrafter
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

from test_sync_drafter import greedy_continuation

K = 4
BLOCK = 16


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make(model, mode: str, num_blocks: int, **options):
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK))
    if mode == "sync":
        return SyncDrafter(runner, vocab_size=model.config.vocab_size)
    return SSDDrafter(runner, vocab_size=model.config.vocab_size, options={"backup": "jit", **options})


class Requests:
    """Committed contexts on the proposer's side, sent as vLLM's proposer would (new tokens only)."""

    def __init__(self, contexts: dict[str, list[int]]):
        self.contexts = contexts
        self.sent = dict.fromkeys(contexts, 0)
        self.step_id = 0

    def step(self, drafter, ids=None, finished=()):
        rows = []
        for rid in ids if ids is not None else list(self.contexts):
            ctx = self.contexts[rid]
            rows.append(RowUpdate(rid, self.sent[rid], ctx[self.sent[rid]:], K,
                                  SamplingSpec() if self.sent[rid] == 0 else None))
            self.sent[rid] = len(ctx)
        for rid in finished:
            self.contexts.pop(rid)
        self.step_id += 1
        resp = drafter.step(StepRequest(self.step_id, rows, list(finished)))
        drafter.answered()
        return rows, resp

    def accept(self, rows, resp, model, accepted: int = K):
        """Each row's outcome: `accepted` drafts accepted, then the target's token (a fixed token here);
        rows without drafts get one token."""
        for row, drafts in zip(rows, resp.drafts):
            self.contexts[row.req_id] = self.contexts[row.req_id] + drafts[:accepted] + [7]


def check_exact(model, req: Requests, rows, resp):
    """Every row with drafts got the draft's own greedy continuation of its committed context."""
    for row, drafts in zip(rows, resp.drafts):
        if drafts:
            assert drafts == greedy_continuation(model, req.contexts[row.req_id], len(drafts)), row.req_id


def ctx(seed: int, n: int) -> list[int]:
    return list(map(int, np.random.default_rng(seed).integers(2, 300, n)))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rows_without_room_get_no_drafts_then_resume(draft_model, mode, caplog):
    """6 blocks hold two 40-token requests (3 blocks each with their drafts), not four: two rows get drafts,
    two get none (`noroom`), one warning for several such steps; finishing the first two lets the others
    draft again."""
    drafter = make(draft_model, mode, num_blocks=6, fanout_budget=2)
    req = Requests({f"r{i}": ctx(i, 40) for i in range(4)})
    caplog.set_level(logging.WARNING, logger="saguaro_vllm.drafter")
    served: list[set[str]] = []
    for _ in range(3):
        rows, resp = req.step(drafter)
        check_exact(draft_model, req, rows, resp)
        status = dict(zip(req.contexts, resp.row_status))
        got = {rid for rid, d in zip(req.contexts, resp.drafts) if d}
        assert len(got) == 2, resp.drafts
        assert all(status[rid] == "noroom" for rid in req.contexts if rid not in got), status
        assert all(len(d) == K for d in resp.drafts if d)
        served.append(got)
        req.accept(rows, resp, draft_model, accepted=1)
        while drafter.busy:
            drafter.advance()
    warnings = [r for r in caplog.records if "draft KV cache full" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    first = served[-1]
    rows, resp = req.step(drafter, ids=[r for r in req.contexts if r not in first], finished=sorted(first))
    check_exact(draft_model, req, rows, resp)
    assert all(len(d) == K for d in resp.drafts) and set(resp.row_status) <= {"drafted", "new"}, resp.row_status
    assert drafter.num_out_of_blocks >= 6


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_cache_of_growing_rows_does_not_stall(draft_model, mode):
    """Two rows fill the cache exactly and both need one more block: rather than both stalling until a
    request ends, one lets go of its KV and the other keeps drafting."""
    drafter = make(draft_model, mode, num_blocks=6, fanout_budget=1)
    req = Requests({"a": ctx(10, 44), "b": ctx(11, 44)})  # 44 + 3 draft KV = 47 tokens: 3 blocks each
    rows, resp = req.step(drafter)
    assert all(len(d) == K for d in resp.drafts)
    req.accept(rows, resp, draft_model)  # all accepted: 49 + 3 tokens need a 4th block each
    rows, resp = req.step(drafter)
    check_exact(draft_model, req, rows, resp)
    assert sorted(map(bool, resp.drafts)) == [False, True], resp.drafts
    assert sorted(resp.row_status)[-1] == "noroom"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_context_larger_than_the_whole_cache(draft_model, mode, caplog):
    """3 blocks = 48 tokens: a 60-token context is never speculated (one warning, however many steps and
    such requests); a short request beside it is."""
    drafter = make(draft_model, mode, num_blocks=3, fanout_budget=1)
    req = Requests({"big": ctx(20, 60), "huge": ctx(21, 70), "small": ctx(22, 9)})
    caplog.set_level(logging.WARNING, logger="saguaro_vllm.drafter")
    for _ in range(3):
        rows, resp = req.step(drafter)
        check_exact(draft_model, req, rows, resp)
        assert resp.drafts[0] == resp.drafts[1] == [] and resp.row_status[:2] == ["noroom", "noroom"]
        assert len(resp.drafts[2]) == K
        assert not drafter.runner.has_request("big") and not drafter.runner.has_request("huge")
        req.accept(rows, resp, draft_model, accepted=2)
        while drafter.busy:
            drafter.advance()
    oversize = [r for r in caplog.records if "longer than the drafter's whole KV cache" in r.getMessage()]
    assert len(oversize) == 1


def test_context_near_the_cache_size_gets_fewer_drafts(draft_model):
    """46 tokens in 3 blocks (48): drafting k tokens writes KV for 45 + k, so k = 3, not K."""
    drafter = make(draft_model, "sync", num_blocks=3)
    req = Requests({"a": ctx(30, 46)})
    rows, resp = req.step(drafter)
    assert len(resp.drafts[0]) == 3
    check_exact(draft_model, req, rows, resp)


def test_max_model_len_limits_drafts(draft_model):
    """`max_model_len` 50: a 47-token context gets 3 drafts, a 50-token one none (status none, not noroom)."""
    runner = DraftModelRunner(draft_model, KVCacheConfig(num_blocks=32, block_size=BLOCK))
    drafter = SyncDrafter(runner, vocab_size=draft_model.config.vocab_size, max_model_len=50)
    req = Requests({"a": ctx(40, 47), "b": ctx(41, 50)})
    rows, resp = req.step(drafter)
    assert len(resp.drafts[0]) == 3 and resp.drafts[1] == [] and resp.row_status == ["drafted", "none"]
    check_exact(draft_model, req, rows, resp)


def test_async_branches_never_starve_requests(draft_model):
    """A wide pre-draft fills the cache with branches; the next step, a new request and the owner of those
    branches (absent from that step) are both served before any branch: the branches are dropped, the
    absent request's own KV is kept, and the new request gets its drafts."""
    drafter = make(draft_model, "async", num_blocks=12, fanout_budget=32)
    req = Requests({"a": ctx(50, 30), "b": ctx(51, 40)})
    rows, resp = req.step(drafter, ids=["a"])
    while drafter.busy:
        drafter.advance()
    assert len(drafter.cache) > 0 and drafter.runner.num_free_blocks < 3, drafter.runner.num_free_blocks
    a_len = drafter.runner.num_computed("a")
    rows, resp = req.step(drafter, ids=["b"])
    assert len(resp.drafts[0]) == K and resp.row_status == ["new"]
    check_exact(draft_model, req, rows, resp)
    assert drafter.runner.has_request("a") and drafter.runner.num_computed("a") == a_len
    assert drafter.cache.outcomes("a") == []  # a's branches were dropped for b


def test_sync_evicts_absent_requests_first(draft_model):
    """Requests absent from a step (preempted, waiting) lose their KV before a present row is refused."""
    drafter = make(draft_model, "sync", num_blocks=6)
    req = Requests({"idle": ctx(60, 40), "a": ctx(61, 40), "b": ctx(62, 40)})
    req.step(drafter, ids=["idle", "a"])
    rows, resp = req.step(drafter, ids=["a", "b"])
    assert all(len(d) == K for d in resp.drafts)
    check_exact(draft_model, req, rows, resp)
    assert not drafter.runner.has_request("idle") and "idle" in drafter.reqs  # context kept: no resync
    rows, resp = req.step(drafter, ids=["idle"], finished=["a", "b"])
    assert len(resp.drafts[0]) == K and resp.resync == []
    check_exact(draft_model, req, rows, resp)
