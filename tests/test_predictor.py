"""Outcome prediction: the candidate exclusion rule and order, the geometric fan-out rounded to the budget,
the acceptance estimate, the allocation after a fast-backup miss, and sizing the budget from timings."""

from __future__ import annotations

import doctest
import itertools
import math
import random

import pytest
import torch

import saguaro_vllm.drafter.predictor as predictor_module
from saguaro_vllm.drafter.predictor import (
    MAX_RANK,
    AcceptanceEstimate,
    OutcomePredictor,
    OutcomeStats,
    PreDraftPlan,
    StepCostModel,
    allocate_fanout,
    depth_probs,
    plan_predraft,
    select_candidates,
    top_tokens,
)


def test_doctests():
    assert doctest.testmod(predictor_module).failed == 0


def test_candidates_exclude_the_drafted_token_below_depth_k():
    scores = torch.tensor([
        [0.0, 5.0, 4.0, 9.0, 1.0, 0.0],  # depth 0: x1 = 3 is the best, excluded
        [7.0, 7.0, 2.0, 1.0, 0.0, 8.0],  # depth 1: x2 = 5 is the best, excluded; 0 and 1 tie -> 0 first
        [0.0, 0.0, 0.0, 9.0, 0.0, 1.0],  # depth K = 2: nothing excluded, even a drafted token
    ])
    cands = select_candidates(scores, drafts=[3, 5], fanout=[2, 2, 2])
    assert cands == [(0, 1), (1, 0), (2, 3), (0, 2), (1, 1), (2, 5)]  # every depth's best first
    assert select_candidates(scores, [3, 5], [0, 1, 0]) == [(1, 0)]
    assert select_candidates(scores, [3, 5], [0, 0, 0]) == []
    everything = select_candidates(scores, [3, 5], [9, 9, 9])  # wider than the vocabulary
    by_depth = [[t for j, t in everything if j == d] for d in range(3)]
    assert sorted(by_depth[0]) == [0, 1, 2, 4, 5] and sorted(by_depth[1]) == [0, 1, 2, 3, 4]
    assert sorted(by_depth[2]) == list(range(6))
    with pytest.raises(ValueError, match="K=2 drafts need 3"):
        select_candidates(scores, [3, 5], [1, 1])


def test_candidates_never_contain_a_rejected_token_random():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        k = int(torch.randint(1, 6, (1,), generator=g))
        scores = torch.randn(k + 1, 50, generator=g)
        drafts = scores[:k].argmax(-1).tolist()  # the greedy drafts: always the top token
        fanout = torch.randint(0, 4, (k + 1,), generator=g).tolist()
        cands = select_candidates(scores, drafts, fanout)
        assert all(t != drafts[j] for j, t in cands if j < k)
        for j in range(k + 1):
            toks = [t for d, t in cands if d == j]
            assert len(toks) == fanout[j] and len(set(toks)) == len(toks)
            assert toks == sorted(toks, key=lambda t: -scores[j, t])


@pytest.mark.parametrize("r", [0.0, 0.5, 1.0, 3.0])
def test_fanout_sums_to_the_budget_and_rounds_by_largest_remainder(r):
    for budget, alpha, k in itertools.product([0, 1, 2, 5, 7, 16, 63], [0.0, 0.1, 0.5, 0.8, 0.97, 1.0], [1, 3, 6]):
        f = allocate_fanout(budget, alpha, k, r)
        assert len(f) == k + 1 and sum(f) == budget and min(f) >= 0
        w = [p ** (1 / (1 + r)) for p in depth_probs(alpha, k)]
        ideal = [budget * x / sum(w) for x in w]
        assert all(math.floor(x) <= n <= math.floor(x) + 1 for x, n in zip(ideal, f, strict=True))


def test_fanout_has_the_geometric_shape():
    alpha, r, k, budget = 0.8, 1.0, 5, 10_000
    f = allocate_fanout(budget, alpha, k, r)
    ratio = alpha ** (1 / (1 + r))
    for j in range(k - 1):  # f_j = f_0 alpha^(j/(1+r)) below K
        assert f[j + 1] / f[j] == pytest.approx(ratio, rel=1e-3)
    # ... and the larger last term f_K = f_0 alpha^(K/(1+r)) (1-alpha)^(-1/(1+r))
    assert f[k] / f[0] == pytest.approx(alpha ** (k / (1 + r)) * (1 - alpha) ** (-1 / (1 + r)), rel=1e-3)
    assert f[k] > f[k - 1]
    assert allocate_fanout(9, 0.0, 4) == [9, 0, 0, 0, 0]
    assert allocate_fanout(9, 1.0, 4) == [0, 0, 0, 0, 9]
    # A weaker draft moves the budget towards depth 0.
    assert allocate_fanout(12, 0.3, 4)[0] > allocate_fanout(12, 0.9, 4)[0]
    with pytest.raises(ValueError):
        allocate_fanout(-1, 0.5, 3)


def test_acceptance_estimate():
    est = AcceptanceEstimate(prior=0.6, prior_weight=4.0, decay=1.0)
    assert est.alpha == pytest.approx(0.6)
    for a in [4, 0, 2]:  # K=4: examined 4, 1, 3 drafts; accepted 4, 0, 2
        est.observe(a, 4)
    assert est.alpha == pytest.approx((2.4 + 6) / (4 + 8))
    with pytest.raises(ValueError):
        est.observe(5, 4)

    rng = random.Random(0)
    for true_alpha in [0.3, 0.85]:
        est = AcceptanceEstimate(decay=0.995)
        for _ in range(3000):
            a = 0
            while a < 5 and rng.random() < true_alpha:
                a += 1
            est.observe(a, 5)
        assert est.alpha == pytest.approx(true_alpha, abs=0.04)


def test_after_a_fast_backup_the_budget_sits_at_depth_0_until_backups_get_accepted():
    pred = OutcomePredictor()
    assert pred.fanout(8, 4, fast_backup=True) == [8, 0, 0, 0, 0]
    neural = pred.fanout(8, 4)
    assert sum(neural) == 8 and neural[0] < 8 and neural[4] > 0
    for _ in range(50):  # n-gram backups that the target keeps accepting
        pred.observe(4, 4, fast_backup=True)
    assert pred.fanout(8, 4, fast_backup=True)[0] < 8
    assert pred.fanout(8, 4) == neural  # the neural estimate is separate


def test_plan_predraft_fits_and_more_time_never_scores_less():
    from saguaro_vllm.drafter.predictor import expected_hit_rate, plan_predraft

    cost = StepCostModel(0.002, 0.0001)
    scores = []
    for verify_ms in range(120):
        verify_s = verify_ms / 1000
        plan = plan_predraft(verify_s, cost, batch_size=4, k=4, alpha=0.8, max_branches=32)
        if plan.branches == 0:
            assert cost.step_s(4) + cost.step_s(4) > verify_s  # not even one step of one branch fits
            scores.append(0.0)
            continue
        assert cost.step_s(4) + plan.steps * cost.step_s(4 * plan.branches) <= verify_s
        scores.append(expected_hit_rate(allocate_fanout(plan.branches, 0.8, 4), 0.8) * plan.steps)
    assert scores == sorted(scores)  # more time never plans a worse pre-draft
    assert scores[0] == 0.0 and plan == PreDraftPlan(32, 4)  # nothing fits / capped by max_branches


def test_plan_predraft_without_per_row_cost_uses_the_cap():
    from saguaro_vllm.drafter.predictor import plan_predraft

    assert plan_predraft(0.01, StepCostModel(0.001, 0.0), 8, 4, 0.8, max_branches=16) == PreDraftPlan(16, 4)
    assert plan_predraft(0.001, StepCostModel(0.001, 0.0), 8, 4, 0.8) == PreDraftPlan(0, 0)


def test_step_cost_model_fit():
    samples = [(rows, 0.0015 + 0.00002 * rows) for rows in (1, 8, 32, 64)]
    fit = StepCostModel.fit(samples)
    assert fit.fixed_s == pytest.approx(0.0015) and fit.per_row_s == pytest.approx(0.00002)
    assert StepCostModel.fit([(4, 0.003), (4, 0.005)]) == StepCostModel(0.004, 0.0)
    with pytest.raises(ValueError):
        StepCostModel.fit([])


def test_plan_predraft_prefers_depth_and_stays_in_time():
    from saguaro_vllm.drafter.predictor import expected_hit_rate, plan_predraft

    cost = StepCostModel(0.020, 0.0013)
    for verify in (0.05, 0.1, 0.16, 0.3, 1.0):
        for batch in (1, 4, 16):
            plan = plan_predraft(verify, cost, batch, 5, 0.8, max_branches=32)
            if plan.branches:
                assert cost.step_s(batch) + plan.steps * cost.step_s(batch * plan.branches) <= verify
    # Plenty of time: full depth and as wide as allowed.
    assert plan_predraft(1.0, cost, 1, 5, 0.8, max_branches=32) == PreDraftPlan(32, 5)
    # Nothing fits: no plan.
    assert plan_predraft(0.03, cost, 1, 5, 0.8) == PreDraftPlan(0, 0)
    # More branches never lower the modelled hit rate.
    rates = [expected_hit_rate(allocate_fanout(m, 0.8, 5), 0.8) for m in range(1, 30)]
    assert all(b >= a - 1e-12 for a, b in zip(rates, rates[1:]))


def test_branches_pay_off():
    from saguaro_vllm.drafter.predictor import branches_pay_off

    cost = StepCostModel(0.015, 0.001)  # a jit draft of one row: 5 x 16 ms
    args = dict(k=5, verify_s=0.3, cost=cost, alpha=0.6, tokens_ngram=1.1)
    # Batch 1: a hit saves the 80 ms jit draft with probability h = 0.3; worth 20 ms of lateness, not 30.
    for policy in ("jit", "auto"):
        assert branches_pay_off(0.3, 1, late_s=0.020, policy=policy, **args)
        assert not branches_pay_off(0.3, 1, late_s=0.030, policy=policy, **args)
    # Batch 4, h = 0.5: with jit backups one miss (15 of 16 rounds) stalls every row and the steps only
    # delay the answer; with per-row backups the hits are answered and the misses keep n-gram drafts.
    sampled = {**args, "verify_s": 0.28, "alpha": 0.7}
    assert not branches_pay_off(0.5, 4, late_s=0.015, policy="jit", **sampled)
    assert branches_pay_off(0.5, 4, late_s=0.015, policy="auto", **sampled)
    # Too few hits for either: no branch steps.
    assert not branches_pay_off(0.1, 4, late_s=0.015, policy="auto", **sampled)
    # No lateness: always worth it when any hit is possible.
    assert branches_pay_off(0.05, 8, late_s=0.0, policy="jit", **args)


@pytest.mark.parametrize("rows,vocab,n,ties", [(1, 50, 5, False), (7, 300, 17, True), (4, 128256, 9, True),
                                               (3, 10, 10, True), (2, 8, 20, False)])
def test_top_tokens_equal_a_stable_descending_sort(rows, vocab, n, ties):
    """The topk-based selection gives exactly a stable descending sort's first n ids, ties to the lower id
    (integer-valued scores make many ties, also across the n-th place)."""
    gen = torch.Generator().manual_seed(rows * vocab + n)
    scores = torch.randint(0, 6, (rows, vocab), generator=gen).float() if ties else torch.randn(rows, vocab, generator=gen)
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n].tolist()
    assert top_tokens(scores, n) == want


def test_top_tokens_with_masked_tokens_and_no_data_dependent_shapes():
    """Rows with -inf (masked) tokens, fewer finite ones than n: the -inf ties fill the rest lowest ids
    first, as a stable sort does (a second transfer for such rows); float scores take one transfer; and
    the selection never asks for a tensor whose size depends on its data (`nonzero`, boolean indexing),
    which a GPU would make the host wait for."""
    from sync_count import CountTransfers

    gen = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 4, (3, 40), generator=gen).float()
    scores[:, ::3] = float("-inf")
    scores[1, 5:] = float("-inf")  # row 1: 5 finite tokens, n = 12
    want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :12].tolist()
    with CountTransfers() as counter:
        assert top_tokens(scores, 12) == want
    assert counter.total == 2 and counter.data_dependent == 0, counter.where  # ties past the 12th: a second
    distinct = torch.randn(4, 1000, generator=gen)
    want = torch.sort(distinct, dim=-1, descending=True, stable=True).indices[:, :65].tolist()
    with CountTransfers() as counter:
        got = top_tokens(distinct, 65)
    assert got == want
    assert counter.total == 1 and counter.data_dependent == 0, counter.where  # float logits: one transfer


def test_forward_cost_fit_separates_tokens_from_logit_rows():
    """A forward costs fixed + per token fed + per logit row: a 128-token prefill chunk (one logit) is not
    128 decode rows."""
    truth = StepCostModel(0.002, 0.00002, 0.0005)
    shapes = [(1, 1), (16, 16), (128, 1), (32, 32), (16, 96), (300, 4)]
    fit = StepCostModel.fit_forwards([(t, lg, truth.forward_s(t, lg)) for t, lg in shapes])
    assert fit.fixed_s == pytest.approx(0.002, rel=1e-6) and fit.per_row_s == pytest.approx(0.00002, rel=1e-5)
    assert fit.per_logit_s == pytest.approx(0.0005, rel=1e-6) and fit.max_rows == 96


def test_forward_cost_fit_does_not_extrapolate_unmeasured_sizes_as_free():
    """Forwards all of one size cannot tell a fixed cost from a per-row one: the proportional model is
    taken, so a forward 16x larger is predicted 16x dearer (the fixed-cost reading predicted 256 rows at
    31 ms where 0.77 s was measured at vocabulary 128k); one-token forwards put the per-row cost on tokens."""
    fit = StepCostModel.fit_forwards([(16, 16, 0.0093), (16, 16, 0.0095), (16, 16, 0.0094)])
    assert fit.fixed_s == 0.0 and fit.step_s(256) == pytest.approx(16 * 0.0094, rel=1e-3)
    assert fit.per_logit_s == 0.0 and fit.max_rows == 16
    spread = StepCostModel.fit_forwards([(r, r, 0.01 + 0.001 * r) for r in (1, 2, 4, 8, 16)])
    assert spread.fixed_s == pytest.approx(0.01) and spread.step_s(3) == pytest.approx(0.013)


def test_plan_does_not_grow_past_twice_the_largest_measured_forward():
    cost = StepCostModel(0.001, 0.0001, max_rows=16)
    free = plan_predraft(1.0, cost, batch_size=16, k=5, alpha=0.8, max_branches=32)
    capped = plan_predraft(1.0, cost, batch_size=16, k=5, alpha=0.8, max_branches=32, max_rows=32)
    assert free.branches == 32 and capped.branches == 2 and capped.steps == 5


def _t1_like_rounds(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(accepted, rank) of K=5 rounds shaped like the demo pair's at T=1 (2026-12-06 trace): 45 % reject
    the first draft with the bonus spread over ~20 ranks (a fifth not among the candidates), a fifth
    accept all and mostly rank 0-5, the rest in between."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.45:
            out.append((0, rng.randrange(20) if rng.random() < 0.8 else MAX_RANK))
        elif u < 0.65:
            out.append((5, min(int(rng.expovariate(0.5)), MAX_RANK)))
        else:
            out.append((rng.randrange(1, 5), rng.randrange(40)))
    return out


def test_outcome_stats_allocation_spends_the_budget_where_hits_are():
    """Measured ranks and depths move the budget: the flat depth-0 residual gets most branches at T=1
    (the geometric shape gave it 5 of 24); at T=0 (every best candidate right) one branch per depth."""
    stats = OutcomeStats()
    rounds = _t1_like_rounds(400)
    for a, rank in rounds:
        stats.observe(a, 5, rank)
    fan = stats.allocate(24, 5, alpha=0.6)
    assert sum(fan) == 24 and fan[0] >= 12 and fan[5] >= 2
    geometric = allocate_fanout(24, 0.6, 5)
    assert fan[0] > geometric[0]
    # the later half of the rounds (the statistics of the first half): more hits than the geometric shape
    first = OutcomeStats()
    for a, rank in rounds[:200]:
        first.observe(a, 5, rank)
    fan = first.allocate(24, 5, alpha=0.6)
    hits = sum(rank < fan[a] for a, rank in rounds[200:])
    hits_geometric = sum(rank < geometric[a] for a, rank in rounds[200:])
    assert hits > hits_geometric * 1.1
    greedy = OutcomeStats()
    for i in range(120):
        greedy.observe(i % 6, 5, 0)
    assert greedy.allocate(6, 5, alpha=0.9) == [1] * 6
    assert sum(greedy.allocate(40, 5, alpha=0.9)) == 40  # budgets past the measured ranks are still spent


def test_outcome_stats_model_the_hit_rate_they_measured():
    stats = OutcomeStats(decay=1.0)
    rounds = _t1_like_rounds(3000, seed=1)
    for a, rank in rounds:
        stats.observe(a, 5, rank)
    for budget in (6, 12, 24):
        fan = stats.allocate(budget, 5, alpha=0.6)
        # ranks past MAX_RANK are not told apart: the model counts a branch beyond them as catching none
        measured = sum(rank < min(fan[a], MAX_RANK) for a, rank in rounds) / len(rounds)
        assert stats.hit_rate(fan, alpha=0.6) == pytest.approx(measured, abs=0.03)
    # allocation is the best of its budget under the model (greedy on non-increasing rank probabilities)
    best = max((f for f in itertools.product(range(9), repeat=3) if sum(f) == 8),
               key=lambda f: stats.hit_rate([f[0], 0, 0, 0, f[1], f[2]], alpha=0.6))
    fan = stats.allocate(8, 5, alpha=0.6)
    assert stats.hit_rate(fan, 0.6) >= stats.hit_rate([best[0], 0, 0, 0, best[1], best[2]], 0.6) - 1e-12
    with pytest.raises(ValueError):
        stats.observe(6, 5, 0)


def test_outcome_stats_smooth_sparse_depths_and_keep_rank_probabilities_non_increasing():
    stats = OutcomeStats()
    stats.observe(3, 5, 7)  # one rejection at depth 3, its bonus at rank 7
    probs = stats.rank_probs(3, 5)
    assert all(x >= y for x, y in zip(probs, probs[1:], strict=False))
    assert probs[0] > probs[7] > 0  # one observation does not outweigh the pooled prior
    assert stats.rank_probs(5, 5) == pytest.approx(OutcomeStats().rank_probs(5, 5))  # all-accepted: apart
    assert sum(stats.depth_probs(5, 0.7)) == pytest.approx(1.0)
    stats.observe(2, 5, None)  # a round without ranks still counts its accepted count
    assert stats.depths[5][2] == pytest.approx(1.0)



def test_outcome_stats_lazy_decay_equals_decaying_every_count():
    """The tables decay through one scale factor (the answer observes every looked-up row): the same
    counts, probabilities and allocations as multiplying every count at every observation, also after the
    scale is folded back in (decay 0.5: it would underflow after ~1000 observations)."""
    import random

    class Eager:
        def __init__(self, decay):
            self.decay, self.counts = decay, {}

        def observe(self, accepted, k, rank):
            self.counts = {key: [c * self.decay for c in v] for key, v in self.counts.items()}
            self.counts.setdefault(("depth", k), [0.0] * (k + 1))[accepted] += 1.0
            kind = "all" if accepted == k else "residual"
            self.counts.setdefault((kind, accepted), [0.0] * (MAX_RANK + 1))[min(rank, MAX_RANK)] += 1.0

    rng = random.Random(0)
    for decay, n in ((0.99, 400), (0.5, 1200)):
        lazy, eager = OutcomeStats(decay=decay), Eager(decay)
        for _ in range(n):
            k = rng.choice((3, 5))
            a, rank = rng.randint(0, k), min(int(rng.expovariate(0.3)), MAX_RANK + 3)
            lazy.observe(a, k, rank)
            eager.observe(a, k, rank)
        for (kind, key), counts in eager.counts.items():
            got = lazy.depths[key] if kind == "depth" else lazy.ranks[(kind, key)]
            assert got == pytest.approx(counts, rel=1e-9, abs=1e-300)
        assert lazy._scale >= 1e-100
        ref = OutcomeStats(decay=1.0)  # fresh tables holding the eager counts, undecayed from here
        ref._depths = {key: list(v) for (kind, key), v in eager.counts.items() if kind == "depth"}
        ref._ranks = {(kind, key): list(v) for (kind, key), v in eager.counts.items() if kind != "depth"}
        ref._pooled = lazy.pooled
        for j in range(6):
            assert lazy.rank_probs(j, 5) == pytest.approx(ref.rank_probs(j, 5))
        assert lazy.depth_probs(5, 0.7) == pytest.approx(ref.depth_probs(5, 0.7))
        assert lazy.allocate(24, 5, 0.7) == ref.allocate(24, 5, 0.7)


def test_rank_estimate_decays_through_one_scale_as_if_every_count_decayed():
    """`RankEstimate` keeps counts / scale (a decay is one multiplication; every looked-up row observes): its
    counts and hit probabilities equal decaying every count per observation, across a rescale."""
    from saguaro_vllm.drafter.predictor import MAX_RANK, RankEstimate

    lazy, eager = RankEstimate(decay=0.5), RankEstimate(decay=0.5)
    eager_counts = list(eager.counts)
    for i in range(400):  # 0.5 ** 400 underflows the scale's floor: it is folded back in on the way
        rank = (i * 7) % (MAX_RANK + 3)
        lazy.observe(rank)
        eager_counts = [c * 0.5 for c in eager_counts]
        eager_counts[min(rank, MAX_RANK)] += 1.0
        if i % 37 == 0 or i > 395:
            assert lazy.counts == pytest.approx(eager_counts, rel=1e-9, abs=1e-300)
            total = sum(eager_counts)
            for f in (0, 1, 3, MAX_RANK, MAX_RANK + 2):
                assert lazy.hit_prob(f) == pytest.approx(sum(eager_counts[:min(f, MAX_RANK)]) / total, rel=1e-9)
    assert lazy._scale > 1e-100
