"""`mode: async` drafter contract, without vLLM: whatever the outcomes, hits, misses, cut-short
pre-drafts and backups, every greedy answer equals the draft model's own continuation of the committed
context (so vLLM verifies exactly what `mode: sync` would), n-gram backups are the context lookup, the
cache serves hits at every depth, and all KV is freed at the end."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.backup import ngram_drafts
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

from test_sync_drafter import count_slot_writes, greedy_continuation, make_ring, ring_probs

K = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make_drafter(model, num_blocks=256, **options) -> SSDDrafter:
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=16))
    drafter = SSDDrafter(runner, vocab_size=model.config.vocab_size, options={"backup": "jit", **options})
    drafter.probs_ring = make_ring(model)
    return drafter


def draft_logits(model, context: list[int]) -> torch.Tensor:
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=64, block_size=16))
    runner.add_request("ref")
    return runner.forward([("ref", context, 0)])[0, : model.config.vocab_size].clone()


def simulate_outcome(model, context, drafts, rng) -> list[int]:
    """A target that accepts a random prefix and, at the rejection, usually picks the draft's best other
    token (a likely cache hit), sometimes a random one (a miss)."""
    a = int(rng.integers(0, len(drafts) + 1))
    logits = draft_logits(model, context + drafts[:a])
    if a < len(drafts):
        logits[drafts[a]] = float("-inf")
    bonus = int(logits.argmax()) if rng.random() < 0.75 else int(rng.integers(2, 300))
    if a < len(drafts) and bonus == drafts[a]:
        bonus = int(logits.argmax())
    return drafts[:a] + [bonus]


def all_accepted(drafter, ctxs: dict[str, list[int]], drafts: list[list[int]], hits: set[str]) -> list[RowUpdate]:
    """The next step's rows after every draft was accepted: a bonus the pre-draft branched on at depth K for
    the requests in `hits` (a hit), one it did not for the others (a miss)."""
    rows = []
    for j, (rid, ctx) in enumerate(ctxs.items()):
        cached = {t for d, t in drafter.cache.outcomes(rid) if d == K}
        bonus = min(cached) if rid in hits else next(t for t in range(2, 300) if t not in cached)
        rows.append(RowUpdate(rid, len(ctx), drafts[j] + [bonus], K))
    return rows


def run_rounds(model, drafter, rng, rounds=10, advance=lambda rng: 100, contexts=None, late_s=0.0):
    """`late_s` > 0: each request is stamped as sent that long before the drafter takes it (after a
    verification of at least 0.1 s), as when the answer waits for a pre-draft forward in flight."""
    contexts = contexts or {"a": list(map(int, rng.integers(2, 300, 23))), "b": list(map(int, rng.integers(2, 300, 5))),
                            "c": list(map(int, rng.integers(2, 300, 40)))}
    sent = dict.fromkeys(contexts, 0)
    statuses: list[str] = []
    ssd_stats: list[dict] = []
    for step in range(1, rounds + 1):
        rows = []
        for rid, ctx in contexts.items():
            rows.append(RowUpdate(rid, sent[rid], ctx[sent[rid]:], K, SamplingSpec() if sent[rid] == 0 else None))
            sent[rid] = len(ctx)
        sent_at = 0.0
        if late_s:
            time.sleep(late_s + 0.1)
            sent_at = time.monotonic() - late_s
        resp = drafter.step(StepRequest(step, rows, [], sent_at=sent_at))
        drafter.answered()
        for _ in range(advance(rng)):
            drafter.advance()
        assert resp.resync == [] and resp.probs_slot == -1 and not resp.probs_rows
        statuses += resp.row_status
        ssd_stats.append(resp.ssd)
        for row, drafts, status in zip(rows, resp.drafts, resp.row_status):
            ctx = contexts[row.req_id]
            if status == "ngram" or (status == "new" and resp.ssd["backup"] == "ngram"):
                assert drafts == ngram_drafts(ctx, K)
            else:
                assert drafts == greedy_continuation(model, ctx, K), (step, row.req_id, status)
            if drafts:
                contexts[row.req_id] = ctx + simulate_outcome(model, ctx, drafts, rng)
            else:
                contexts[row.req_id] = ctx + [int(rng.integers(2, 300))]
    run_rounds.ssd_stats = ssd_stats
    return statuses, contexts


@pytest.mark.parametrize("advance", ["all", "random", "none"])
def test_greedy_answers_equal_the_draft_continuation(draft_model, advance):
    rng = np.random.default_rng({"all": 0, "random": 1, "none": 2}[advance])
    # A fixed budget: the branch steps always run (whether they pay is a timing question, tested below),
    # so hits, misses and cut-short branches all occur.
    drafter = make_drafter(draft_model, fanout_budget=6)
    steps = {"all": lambda r: 100, "random": lambda r: int(r.integers(0, 6)), "none": lambda r: 0}[advance]
    statuses, _ = run_rounds(draft_model, drafter, rng, advance=steps)
    if advance != "none":
        assert statuses.count("hit") > 0 and statuses.count("jit") > 0, statuses
        if advance == "random":
            assert any(s["cut_short"] for s in run_rounds.ssd_stats)
        # the branch steps' timings went to the branch-row cost, each with the requests it forked from
        branch_steps = list(drafter.planner.branch_costs)
        assert branch_steps and all(p == min(3, rows) for rows, p, _ in branch_steps), branch_steps
        assert max(rows for rows, _, _ in branch_steps) == 3 * 6
        assert drafter.planner.branch_step_s(drafter.planner.cost_model(), 3) is not None
    else:
        assert "hit" not in statuses
    drafter.step(StepRequest(99, [], ["a", "b", "c"]))
    while drafter.busy:  # what the server loop does between requests: frees the dropped branches
        drafter.advance()
    assert drafter.reqs == {} and len(drafter.cache) == 0
    assert drafter.runner.num_free_blocks == 256


@pytest.mark.parametrize("late_s", [0.0, 0.25])
def test_branch_steps_skipped_when_lateness_outweighs_them(draft_model, late_s):
    """With jit backups and 3 rows, branch steps save time only when all rows hit; when the measured
    lateness they cause (0.25 s here) exceeds that saving the drafter stops running them, and with them the
    whole pre-draft (answers stay the draft's continuation, every row then misses); with no lateness it
    keeps pre-drafting."""
    rng = np.random.default_rng(5)
    drafter = make_drafter(draft_model)
    statuses, _ = run_rounds(draft_model, drafter, rng, rounds=8, late_s=late_s)
    stats = run_rounds.ssd_stats
    assert all(s["late_s"] >= late_s for s in stats[1:])
    if late_s:
        assert all(s["verify_s"] >= 0.09 for s in stats[1:])  # the verification, measured apart from lateness
    else:
        assert all(s["late_s"] == 0.0 for s in stats)  # a request taken at once waited for nothing
    # the round before each step ran no branch steps: skipped them after its glue, or (the fallback) did
    # not pre-draft at all, its rows drafted as `sync` does
    skipped = [s["skipped"] or not s["predrafted"] for s in stats]
    if late_s:
        assert not skipped[1] and skipped[-1], skipped  # branches ran until their lateness was measured
        assert statuses[-3:] == ["jit"] * 3
    else:
        assert not any(skipped) and "hit" in statuses


def test_hits_at_every_depth_with_a_wide_fanout(draft_model):
    rng = np.random.default_rng(3)
    drafter = make_drafter(draft_model, fanout=[3, 3, 3, 3, 2])
    statuses, _ = run_rounds(draft_model, drafter, rng, rounds=16)
    assert statuses.count("hit") > statuses.count("jit")
    assert len(drafter.cache.stats.hits_by_depth) >= 3, drafter.cache.stats


def test_ngram_backup(draft_model):
    rng = np.random.default_rng(4)
    drafter = make_drafter(draft_model, backup="ngram", fanout=[1, 0, 0, 0, 1])
    statuses, _ = run_rounds(draft_model, drafter, rng, rounds=8,
                             contexts={"a": [5, 6, 7, 8, 9, 5, 6, 7], "b": [11, 12, 13, 11, 12]})
    assert "ngram" in statuses
    drafter.step(StepRequest(99, [], ["a", "b"]))
    while drafter.busy:
        drafter.advance()
    assert drafter.runner.num_free_blocks == 256


def test_sampled_rows_carry_their_proposal(draft_model):
    drafter = make_drafter(draft_model, fanout=[2, 1, 1, 1, 1], sampling_scale=0.25)
    spec = SamplingSpec(temperature=1.0, seed=7)
    ctx = list(range(2, 30))
    resp = drafter.step(StepRequest(1, [RowUpdate("s", 0, ctx, K, spec)], []))
    drafter.answered()
    for _ in range(10):
        drafter.advance()
    drafts = resp.drafts[0]
    q = ring_probs(drafter, resp)[0]
    assert q.shape[0] == len(drafts) == K
    assert np.allclose(q.sum(-1), 1.0, atol=1e-5) and all(q[j, t] > 0 for j, t in enumerate(drafts))
    # An all-accepted outcome whose bonus is the top candidate at depth K is a hit with probabilities.
    keys = drafter.cache.outcomes("s")
    depth_k = [t for j, t in keys if j == K]
    assert depth_k
    resp = drafter.step(StepRequest(2, [RowUpdate("s", len(ctx), drafts + [depth_k[0]], K)], []))
    assert resp.row_status == ["hit"] and ring_probs(drafter, resp)[0].shape[0] == K and resp.row_depth == [K]


def test_rows_drafted_now_write_their_q_in_place_in_answer_order(draft_model, monkeypatch):
    """A step with a sampled miss (row 0), a sampled hit (row 1) and a greedy miss (row 2): the misses are
    drafted now and their q' goes into the ring slot with one batched write per position, as `sync` writes it
    (held until the answer instead, every forward's sampler wrote fresh memory: 1.4x `sync`'s sampling time
    at batch 16, vocabulary 128k); the hit's branch q' is copied into the slot row reserved for it, so the
    slot's rows follow the answer's order. Each row holds exactly the q' its drafts were drawn from."""
    drafter = make_drafter(draft_model, fanout=[2, 1, 1, 1, 1])
    t1 = SamplingSpec(temperature=1.0, seed=5)
    ctxs = {"m": list(range(2, 20)), "h": list(range(40, 70)), "g": list(range(100, 112))}
    specs = {"m": t1, "h": SamplingSpec(temperature=1.0, seed=6), "g": SamplingSpec()}
    first = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, K, specs[r]) for r, c in ctxs.items()], []))
    ring_probs(drafter, first)
    drafter.answered()
    while drafter.busy:
        drafter.advance()
    rows = all_accepted(drafter, ctxs, first.drafts, hits={"h"})
    for row in rows:
        ctxs[row.req_id] = ctxs[row.req_id] + row.new_tokens
    calls = count_slot_writes(monkeypatch)
    resp = drafter.step(StepRequest(2, rows, []))
    assert resp.row_status == ["jit", "hit", "jit"], resp.row_status
    assert calls == {"put": 1, "put_positions": K}  # the hit's copy; one write per position of the misses
    assert resp.probs_rows == [0, 1] and resp.ssd["sampled_drafts"] == 2 * K
    q = ring_probs(drafter, resp)
    for pos, tok in enumerate(resp.drafts[0]):  # the miss: the draft's softmax at T=1, drawn from
        p = torch.softmax(draft_logits(draft_model, ctxs["m"] + resp.drafts[0][:pos]), -1).numpy()
        np.testing.assert_allclose(q[0][pos], p, rtol=1e-4, atol=1e-7)
        assert q[0][pos][tok] > 0
    assert q[1].shape[0] == len(resp.drafts[1]) == K and np.allclose(q[1].sum(-1), 1.0, atol=1e-5)
    assert all(q[1][j, t] > 0 for j, t in enumerate(resp.drafts[1]))
    assert resp.drafts[2] == greedy_continuation(draft_model, ctxs["g"], K)


@pytest.mark.parametrize("tokens", ["fanout", "fanout+1"])
def test_saguaro_sampling_scales_the_top_f_or_f_plus_1_tokens(draft_model, tokens):
    """A just-in-time draft after a pre-draft round (fan-out 2 at depth 0): its depth-0 proposal is the
    draft's softmax with the top F (`fanout`) or F+1 (`fanout+1`) tokens scaled by C, renormalised."""
    c = 0.25
    drafter = make_drafter(draft_model, fanout=[2, 1, 1, 1, 1], sampling_scale=c, sampling_scale_tokens=tokens)
    ctx = list(range(2, 30))
    first = drafter.step(StepRequest(1, [RowUpdate("s", 0, ctx, K, SamplingSpec(temperature=1.0, seed=3))], []))
    ring_probs(drafter, first)
    drafter.answered()
    while drafter.busy:
        drafter.advance()
    predrafted = {t for _, t in drafter.cache.outcomes("s")}
    miss = next(t for t in range(2, 300) if t not in predrafted and t != first.drafts[0][0])
    ctx = ctx + [miss]  # nothing accepted, a bonus no branch starts with: a miss drafted just in time
    resp = drafter.step(StepRequest(2, [RowUpdate("s", len(ctx) - 1, [miss], K)], []))
    assert resp.row_status == ["jit"] and resp.ssd["scaled_drafts"] == K
    q = torch.from_numpy(ring_probs(drafter, resp)[0][0]).double()
    p = torch.softmax(draft_logits(draft_model, ctx).double(), -1)
    f = 2 + (tokens == "fanout+1")
    top = torch.argsort(p, descending=True)[:f]
    expect = p.clone()
    expect[top] *= c
    expect /= expect.sum()
    assert torch.allclose(q, expect, rtol=1e-4, atol=1e-7), (q[top], expect[top])


@pytest.mark.parametrize(("verify_s", "expect"), [(0.1, "ngram"), (10.0, "jit")])
def test_one_miss_among_hits_is_drafted_now_only_when_worth_the_wait(draft_model, verify_s, expect):
    """Backup `auto`, per row: 7 rows hit and one misses. Drafting the miss now (4 forwards of ~10 ms) would
    hold 7 hit rows that commit ~400 tokens/s on a 0.1 s verification: it gets its n-gram drafts instead;
    behind a 10 s verification the same wait is worth it and the miss is drafted just in time."""
    rng = np.random.default_rng(8)
    drafter = make_drafter(draft_model, backup="auto", fanout=[1, 1, 1, 1, 2])
    ctxs = {f"r{i}": list(map(int, rng.integers(2, 300, 12))) for i in range(8)}
    first = drafter.step(StepRequest(1, [RowUpdate(rid, 0, c, K, SamplingSpec()) for rid, c in ctxs.items()], []))
    drafter.answered()
    while drafter.busy:
        drafter.advance()
    rows = all_accepted(drafter, ctxs, first.drafts, hits=set(list(ctxs)[:7]))
    drafter.planner.costs.clear()  # a measured draft forward: 9 ms + 1 ms per row
    drafter.planner.costs.extend([(1, 1, 0.010), (2, 2, 0.011), (4, 4, 0.013)])
    drafter.planner.answered_at = time.monotonic() - verify_s
    resp = drafter.step(StepRequest(2, rows, [], sent_at=time.monotonic()))
    assert resp.row_status == ["hit"] * 7 + [expect], resp.row_status
    assert resp.ssd["backup"] == expect
    miss_ctx = ctxs["r7"] + rows[7].new_tokens
    want = ngram_drafts(miss_ctx, K) if expect == "ngram" else greedy_continuation(draft_model, miss_ctx, K)
    assert resp.drafts[7] == want
    for j in range(7):
        assert resp.drafts[j] == greedy_continuation(draft_model, ctxs[f"r{j}"] + rows[j].new_tokens, K)


def test_new_requests_left_undrafted_are_pre_drafted_and_hit_next_step(draft_model):
    """Backup `auto` with measured timings: drafting 8 new 60-token prompts now (each its whole prompt
    plus K-1 steps at 1 ms per row) is not worth the wait at the batch's rate, so they get no drafts. Each
    starts a round of zero drafts: the pre-draft feeds its prompt off the critical path and branches on its
    next token's candidates, so the next step hits (drafts at once) where that token was a candidate and
    is drafted just in time for a token or two where it was not. Without it every later step weighs the
    whole (growing) context again and refuses again: measured at vocabulary 128k, batch 16, a whole run
    without one draft; at T=1 with 5-token requests, 202 of 2395 rows drafted."""
    rng = np.random.default_rng(11)
    drafter = make_drafter(draft_model, backup="auto", num_blocks=512, fanout=[3])
    ctxs = {f"n{i}": [int(t) for t in rng.permutation(np.arange(2, 300))[:60]] for i in range(8)}  # no repeats: no n-gram drafts

    def measured(rate: float) -> None:
        drafter.planner.costs.clear()
        drafter.planner.costs.extend([(1, 1, 0.010), (2, 2, 0.011), (4, 4, 0.013)])  # 9 ms + 1 ms per row
        drafter.planner.verify_s, drafter.planner.rate = 0.1, rate
        drafter.planner.answered_at = time.monotonic() - 0.1

    measured(rate=50.0)
    first = drafter.step(StepRequest(1, [RowUpdate(rid, 0, c, K, SamplingSpec()) for rid, c in ctxs.items()], [],
                                     sent_at=time.monotonic()))
    assert first.drafts == [[]] * 8 and first.row_status == ["new"] * 8, first.row_status
    assert all(drafter.runner.num_computed(rid) == 0 for rid in ctxs if drafter.runner.has_request(rid))
    drafter.answered()
    while drafter.busy:
        drafter.advance()
    assert all(drafter.runner.num_computed(rid) >= len(c) for rid, c in ctxs.items())  # prompts fed
    assert all(len(drafter.cache.outcomes(rid)) == 3 and all(a == 0 for a, _ in drafter.cache.outcomes(rid))
               for rid in ctxs)  # fan-out 3 at depth 0: three candidates for the next token
    hit_rows = list(ctxs)[:4]
    nxt = {rid: (greedy_continuation(draft_model, c, 1)[0] if rid in hit_rows else
                 next(t for t in range(2, 300) if t not in {b for _, b in drafter.cache.outcomes(rid)}))
           for rid, c in ctxs.items()}
    measured(rate=50.0)
    rows = [RowUpdate(rid, len(c), [nxt[rid]], K) for rid, c in ctxs.items()]
    second = drafter.step(StepRequest(2, rows, [], sent_at=time.monotonic()))
    assert second.row_status == ["hit"] * 4 + ["jit"] * 4, (second.row_status, second.ssd)
    assert second.ssd["backup"] == "jit", second.ssd  # the misses cost a token or two each: drafted now
    for rid, drafts in zip(ctxs, second.drafts, strict=True):
        assert drafts == greedy_continuation(draft_model, ctxs[rid] + [nxt[rid]], K), rid
