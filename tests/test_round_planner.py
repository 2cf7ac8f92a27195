"""The SSD round planner without a model: what it measures (verification, lateness, rate, answer times, hit
rate) and what it decides from it (plan, whether branches pay, fan-out lists, per-row drafting, depth)."""
from __future__ import annotations

import time

import pytest

from saguaro_vllm.drafter.backup import DraftNow
from saguaro_vllm.drafter.predictor import PreDraftPlan
from saguaro_vllm.drafter.round_planner import PLAN_SAFETY, RoundPlanner, smooth


def _measured(planner: RoundPlanner, verify_s: float = 0.2, late_s: float = 0.01) -> None:
    """One round as the drafter sees it: answered, a verification of `verify_s`, a request taken late."""
    planner.answered_at = time.monotonic() - verify_s - late_s
    planner.measure_round(time.monotonic() - late_s, ran_branches=True)


def test_verification_and_lateness_are_measured_on_the_shared_clock():
    planner = RoundPlanner({})
    assert planner.measure_round(time.monotonic(), ran_branches=True) == (0.0, 0.0)  # nothing answered yet
    planner.answered_at = time.monotonic() - 0.30
    verify_s, late_s = planner.measure_round(time.monotonic() - 0.05, ran_branches=True)
    assert verify_s == pytest.approx(0.25, abs=0.02) and late_s == pytest.approx(0.05, abs=0.02)
    assert planner.answered_at is None and planner.late_s == pytest.approx(late_s)
    planner.answered_at = time.monotonic() - 0.1
    planner.measure_round(time.monotonic(), ran_branches=False)  # a skipped round tells no lateness
    assert planner.late_s == pytest.approx(late_s)
    assert planner.verify_s == pytest.approx(smooth(verify_s, 0.1), abs=0.02)
    # A send time from the future (another clock) is not trusted: the request's arrival counts instead.
    planner.answered_at = time.monotonic() - 0.1
    _, late = planner.measure_round(time.monotonic() + 100.0, ran_branches=True)
    assert late == pytest.approx(0.0, abs=0.01)


def test_rate_answer_times_and_hit_rate():
    planner = RoundPlanner({})
    planner.end_step(0.02, sent_tokens=12, hits=1, looked_up=2, jit=True, all_hit=False)
    planner.end_step(0.005, sent_tokens=12, hits=2, looked_up=2, jit=False, all_hit=True)
    assert planner.miss_cost_s() == pytest.approx(0.015)
    assert planner.hit_rate == pytest.approx(smooth(0.5, 1.0)) and planner.sent_tokens == 12
    planner.measure_rate(10, verify_s=0.195)
    assert planner.rate == pytest.approx(10 / 0.2)
    planner.measure_rate(10, verify_s=0.0)  # no verification measured: no rate
    assert planner.rate == pytest.approx(50.0)


def test_plan_before_and_after_timings():
    planner = RoundPlanner({})
    assert planner.plan(1, 5) == PreDraftPlan(6, 5)  # one branch per depth until timings are known
    assert planner.branches_pay_off(PreDraftPlan(6, 5, hit_rate=0.1), 1, 5)  # nothing measured: run them
    for rows, seconds in ((1, 0.011), (2, 0.012), (8, 0.018)):
        planner.record_forward(rows, seconds)
    _measured(planner, verify_s=0.2)
    plan = planner.plan(1, 5)
    cost = planner.cost_model()
    # The plan fits in PLAN_SAFETY x verification: glue plus its steps over its branches.
    assert cost.step_s(1) + plan.steps * cost.step_s(plan.branches) <= PLAN_SAFETY * planner.verify_s + 1e-9
    assert plan.branches > 6 and plan.hit_rate is not None
    # A verification too short for even one branch per depth: the most likely outcomes, one step.
    planner.verify_s = 0.001
    assert planner.plan(1, 5) == PreDraftPlan(2, 1)
    assert RoundPlanner({"fanout": [2, 1, 1]}).plan(4, 2) == PreDraftPlan(4, 2)
    assert RoundPlanner({"fanout_budget": 9}).plan(4, 5) == PreDraftPlan(9, 5)


def test_fixed_fanout_applies_to_ngram_rounds_and_short_drafts():
    planner = RoundPlanner({"fanout": [2, 1, 1, 1, 3]})
    assert planner.fanout_for(4, fast=True, budget=99) == [2, 1, 1, 1, 3]
    assert planner.fanout_for(2, fast=True, budget=99) == [2, 1, 3]  # depths 0..k-1, then the last
    own = RoundPlanner({"fanout": [2, 1, 1, 1, 3], "miss_fanout": [4, 0, 0, 0, 1]})
    assert own.fanout_for(4, fast=True, budget=99) == [4, 0, 0, 0, 1]
    assert own.fanout_for(4, fast=False, budget=99) == [2, 1, 1, 1, 3]
    assert sum(RoundPlanner({}).fanout_for(4, fast=False, budget=7)) == 7


def test_fanout_follows_the_calibrated_outcomes_of_the_requests_temperature():
    """Neural rounds take their temperature's measured outcomes (`OutcomeStats.allocate`); an unmeasured
    temperature, n-gram rounds and calls without a temperature keep the geometric shape."""
    planner = RoundPlanner({})
    geometric = planner.fanout_for(5, fast=False, budget=24)
    for i in range(60):  # T=1: rejections of the first draft with the bonus spread over ranks 0..19
        planner.observe_rank(1.0, 0, 5, i % 20) if i % 3 else planner.observe_rank(1.0, 5, 5, 0)
    hot = planner.fanout_for(5, fast=False, budget=24, temperature=1.0)
    assert sum(hot) == 24 and hot[0] >= 15 > geometric[0] and hot[5] >= 1
    assert planner.fanout_for(5, fast=False, budget=24, temperature=0.0) == geometric  # not measured
    assert planner.fanout_for(5, fast=False, budget=24) == geometric
    assert planner.fanout_for(5, fast=True, budget=24, temperature=1.0) == planner.predictor.fanout(24, 5, True)
    assert sum(planner.ranks.counts) > 20  # the pooled ranks (the plan's model, decayed) see every lookup too


def test_draft_now_uses_the_measured_costs_and_rate():
    planner = RoundPlanner({})
    miss = [DraftNow(0, 1, 5, 2.5)]
    assert planner.draft_now(miss, 30.0) == [0]  # nothing measured: every candidate, as sync would
    for rows, seconds in ((1, 0.011), (2, 0.012), (8, 0.018)):
        planner.record_forward(rows, seconds)
    _measured(planner, verify_s=0.1)
    planner.rate = 300.0  # 2.5 tokens for ~55 ms at 300 tokens/s: not worth it
    assert planner.draft_now(miss, 30.0) == []
    planner.rate = 10.0
    assert planner.draft_now(miss, 30.0) == [0]
    assert RoundPlanner({"backup": "ngram"}).draft_now(miss + [DraftNow(1, 1, 2, 1.0, topup=True)], 5.0) == [1]


def test_depth_only_with_depth_auto():
    assert RoundPlanner({}).choose_depth(4, 8, 0.1) is None
    planner = RoundPlanner({"depth": "auto"})
    assert planner.choose_depth(0, 8, 0.1) is None  # an empty step
    assert planner.choose_depth(1, 8, 0.0) == 8  # starts at the maximum
    assert planner.depth_choice.k_max == 8


def test_a_shallow_depth_does_not_trap_itself():
    """The pre-draft of a round at depth 3 plans at most 3 steps; judged by that plan, deeper rows would
    all need top-ups on the critical path and the depth would stay at 3. The planner judges each depth by the
    plan a round at that depth would get, so it goes back to the depth the measured costs favour (here:
    a 26 ms draft forward, verification 150 ms + 6 ms per token, acceptance 0.8, hit rate 0.9)."""
    planner = RoundPlanner({"depth": "auto"})
    for rows, seconds in ((1, 0.026), (2, 0.028), (8, 0.040)):
        planner.record_forward(rows, seconds)
    for _ in range(40):
        planner.predictor.neural.observe(4, 5)
    planner.hit_rate = 0.9
    planner.choose_depth(1, 8, 0.0)
    planner.depth_choice.depth = 3
    for _ in range(40):
        verify = 0.150 + 0.006 * (1 + planner.depth)
        planner.sent_tokens = 1 + planner.depth
        planner.answered_at = time.monotonic() - verify
        planner.measure_round(time.monotonic(), ran_branches=True)
        planner.choose_depth(1, 8, verify)
    assert planner.depth_choice.depth >= 4, planner.depth_choice.depth


def test_branch_steps_follow_the_measured_hit_rate_and_probe_again():
    """The plan models a high hit rate, but at batch 32 the rounds that ran branch steps hit 2 rows of 32
    whose outcomes their fan-out covered (the branches were missing at the lookup): with jit-only backups
    the steps do not pay, and skipping them stops; every PROBE_EVERY-th round in a row runs them anyway (so
    a changed workload is measured again)."""
    from saguaro_vllm.drafter.round_planner import PROBE_EVERY

    planner = RoundPlanner({"backup": "jit"})
    for rows, seconds in ((1, 0.011), (8, 0.018), (64, 0.075)):
        planner.record_forward(rows, seconds)
    _measured(planner, verify_s=0.3, late_s=0.04)
    plan = PreDraftPlan(4, 5, hit_rate=0.95)
    assert planner.branches_pay_off(plan, 32, 5)  # nothing measured with branches yet: the model decides
    planner.end_step(0.05, 192, hits=2, looked_up=32, jit=True, all_hit=False, ran_branches=True, planned=32,
                     covered=32)
    # a round that skipped its branch steps hit nothing, but says its outcomes were covered: not a completion
    planner.end_step(0.05, 192, hits=0, looked_up=32, jit=True, all_hit=False, ran_branches=False, planned=32,
                     covered=30)
    assert planner.completion == pytest.approx(3 / 33)
    assert planner.coverage == pytest.approx((0.9 * 32 + 30 + 1) / (0.9 * 32 + 32 + 2))
    assert planner.branch_hit_floor() == pytest.approx(planner.coverage * 3 / 33)
    decisions = [planner.branches_pay_off(plan, 32, 5) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1] and decisions[-1]


def test_ngram_lookups_only_where_a_miss_may_keep_them():
    assert RoundPlanner({"backup": "ngram"}).needs_ngram_drafts()
    assert not RoundPlanner({"backup": "jit"}).needs_ngram_drafts()
    planner = RoundPlanner({})
    assert not planner.needs_ngram_drafts()  # nothing measured: every miss is drafted now
    for rows, seconds in ((1, 0.011), (2, 0.012), (8, 0.018)):
        planner.record_forward(rows, seconds)
    _measured(planner)
    assert planner.needs_ngram_drafts()


def _gpu_like(planner: RoundPlanner, late_s: float = 5e-5) -> None:
    """Costs like benchmarks/cost_models/h100-70b-tp4-1b.json at batch 1: a draft forward of ~1 ms plus 8.3 us
    per row (rows nearly free), a verification of 18.5 ms, the request taken 50 us after its send."""
    for rows in (1, 6, 12, 24, 48, 96):
        planner.record_forward(rows, 0.000975 + 8.34e-6 * rows)
    _measured(planner, verify_s=0.0185, late_s=late_s)


def test_rows_nearly_free_a_wide_budget_at_batch_1():
    """Under GPU-like costs the whole K-step plan of many branches fits a verification: the budget is the
    cap (max_fanout_budget, 128 by default), not the 1-6 branches a CPU core fits. 128 rather than 64
    (2026-12-06): replayed under the H100 70B TP4 + 1B model the demo pair's batch-1 hit rate rises from
    0.53 to 0.61 at T=0.7 and from 0.28 to 0.38 at T=1; a given cap still bounds it."""
    planner = RoundPlanner({})
    _gpu_like(planner)
    plan = planner.plan(1, 5)
    assert plan.branches == 128 and plan.steps == 5
    capped = RoundPlanner({"max_fanout_budget": 24})
    _gpu_like(capped)
    assert capped.plan(1, 5).branches == 24


def test_the_planners_fallback_cap_is_the_configs_default():
    from saguaro_vllm.drafter.round_planner import MAX_FANOUT_BUDGET
    from saguaro_vllm.frontend.config import SaguaroOptions

    assert MAX_FANOUT_BUDGET == SaguaroOptions.model_fields["max_fanout_budget"].default


def test_a_few_missed_rounds_at_batch_1_do_not_switch_the_branch_steps_off():
    """A round of one row that missed is weak evidence: at batch 1 the first round after a new request
    missed, the measured hit rate read 0, and under GPU costs (lateness 50 us against a 5 ms jit draft) the
    branch steps were skipped 15 rounds of 16 (projection of 2026-12-06: at T=1 in 60 of 96 rounds, hit rate
    0.09). Laplace's rule keeps several misses from reading as "never": here 8 outcomes in a row outside the
    fan-out."""
    from saguaro_vllm.drafter.round_planner import PROBE_EVERY

    planner = RoundPlanner({})
    _gpu_like(planner)
    plan = planner.plan(1, 5)
    for _ in range(8):
        planner.end_step(0.005, 6, hits=0, looked_up=1, jit=True, all_hit=False, ran_branches=True, planned=1)
    assert planner.completion == 1.0 and 0.1 < planner.branch_hit_floor() < 0.2
    assert all(planner.branches_pay_off(plan, 1, 5) for _ in range(PROBE_EVERY))


def test_outcomes_covered_while_the_branch_steps_were_skipped_switch_them_back_on():
    """The floor's coverage counts every planned round, its branch steps run or skipped. Measured on the demo
    pair, batch 1, T=1 (2026-12-06): the first five branched rounds missed (bonus tokens ranked >= 64), the
    floor of branched rounds alone read 1/7, the steps ran in probe rounds only (15 of 81), and outcomes of
    rank 0-3 that the planned fan-out covered in the skipped rounds were never branched for (hit rate 0.00).
    Here the skipped rounds' covered outcomes raise the floor, and the steps run again before any probe."""
    from saguaro_vllm.drafter.round_planner import PROBE_EVERY

    planner = RoundPlanner({})
    for rows in (1, 6, 12, 24, 48, 96):  # a jit draft costs little against the verification: a close call
        planner.record_forward(rows, 0.004 + 2e-5 * rows)
    _measured(planner, verify_s=0.0185, late_s=0.006)  # the steps pay from a hit rate of ~0.3 on
    plan = PreDraftPlan(24, 5, hit_rate=0.5)
    for _ in range(5):
        planner.end_step(0.02, 6, hits=0, looked_up=1, jit=True, all_hit=False, ran_branches=True, planned=1)
    assert not planner.branches_pay_off(plan, 1, 5)
    decisions = []
    for _ in range(PROBE_EVERY - 2):
        planner.end_step(0.02, 6, hits=0, looked_up=1, jit=True, all_hit=False, ran_branches=False, planned=1,
                         covered=1)
        decisions.append(planner.branches_pay_off(plan, 1, 5))
    assert planner.completion == 1.0 and planner.coverage > 0.6
    assert any(decisions) and decisions[-1]
    # a row whose round reached no plan (the request came before the glue forward) says nothing either way
    floor = planner.branch_hit_floor()
    planner.end_step(0.02, 6, hits=0, looked_up=1, jit=True, all_hit=False, ran_branches=False)
    assert planner.branch_hit_floor() == floor


def test_a_miss_at_batch_1_is_weighed_against_the_long_run_rate():
    """The rate a row's gain is weighed against is the steps' long-run one (decayed sums of tokens and of
    whole periods, lateness included), not a moving average of the last steps' own rates, which followed
    the hits (6 tokens per 120 ms verification) and left misses and top-ups to n-gram drafts at batch 1
    where drafting them paid (lead (c) of issue 27 item 5). Here: after a miss and four hits at 10 ms
    lateness, the long-run rate is ~35 tokens/s, and a miss (E(0.8, 5) - 1 = 2.7 tokens for 5 forwards of
    15 ms) is drafted now; the moving average read 42.8 and left it."""
    from saguaro_vllm.drafter.backup import expected_tokens

    planner = RoundPlanner({})
    for rows, seconds in ((1, 0.015), (2, 0.0151), (8, 0.0155)):
        planner.record_forward(rows, seconds)
    for _ in range(60):
        planner.predictor.neural.observe(4, 5)
    steps = [(6, 0.0005), (1, 0.0755), (6, 0.0005), (6, 0.0005), (6, 0.0005)]  # tokens, the step's answer
    for tokens, answer_s in steps:
        planner.observe_round(0.12, 0.01, ran_branches=True)
        planner.measure_rate(tokens, 0.12)
        planner.end_step(answer_s, 6, hits=1, looked_up=1, jit=answer_s > 0.01, all_hit=answer_s < 0.01)
    periods = [0.12 + 0.01 + prev for prev in (0.0, 0.0005, 0.0755, 0.0005, 0.0005)]
    weights = [0.9 ** (len(steps) - 1 - i) for i in range(len(steps))]
    expected = sum(w * t for w, (t, _) in zip(weights, steps)) / sum(w * s for w, s in zip(weights, periods))
    assert planner.rate == pytest.approx(expected) and planner.rate < 36
    planner.observe_round(0.12, 0.01, ran_branches=True)
    miss = [DraftNow(0, 1, 5, expected_tokens(planner.predictor.neural.alpha, 5) - 1.0)]
    assert planner.draft_now(miss, 1.0) == [0]


def test_observing_ranks_keeps_one_statistics_object_per_temperature(monkeypatch):
    """The answer observes every looked-up row: the statistics of a temperature are made once, not built and
    thrown away per row (`setdefault`'s default did that: ~4 us of a row, 0.26 ms of a batch-64 answer)."""
    from saguaro_vllm.drafter import round_planner

    made = []
    real = round_planner.OutcomeStats

    class Counted(real):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(round_planner, "OutcomeStats", Counted)
    planner = RoundPlanner({})
    for i in range(50):
        planner.observe_rank(0.7 if i % 2 else 0.0, i % 3, 5, i % 7)
    assert len(made) == 2 and len(planner.outcomes) == 2


def _request_forward_s(rows: int) -> float:
    """A request's own forward on the 2-core machine of 2026-12-07 (batch 16, T=0.7): ~28 ms + 2.8 ms/row."""
    return 0.028 + 0.0028 * rows


def test_branch_steps_are_costed_by_their_forked_rows():
    """A branch row shares its request's KV: beyond the requests' own rows a branch step costs what its
    measured steps add per further row (~0.7 ms here), not a request row's 2.8 ms: costed like request rows,
    3 branches per request fit a 0.95 s verification at batch 16 where 9 do. Until 2026-12-07 one fit over
    every forward mixed the two, and its cost per row followed how many branch steps its window held. The
    requests' own cost model (glue, jit drafts, backups) is left as their forwards measured it."""
    planner = RoundPlanner({})
    for rows in (1, 4, 8, 12, 16):
        planner.record_forward(rows, _request_forward_s(rows))
    planner.observe_round(1.0, 0.01, ran_branches=True)
    assert planner.branch_step_s(planner.cost_model(), 16) is None  # no branch step measured yet
    # costed like request rows, and grown from the largest forward measured (16 rows, GROWTH)
    assert (planner.plan(16, 5).branches, planner.plan(16, 5).steps) == (2, 5)

    def branch_forward_s(rows: int) -> float:  # measured branch steps over 16 requests
        return _request_forward_s(16) + 0.008 + 0.0007 * (rows - 16)

    for rows in (48, 80, 128):
        planner.record_forward(rows, branch_forward_s(rows), parents=16)
    cost = planner.cost_model()
    assert cost.step_s(16) == pytest.approx(_request_forward_s(16))  # the branch steps left it alone
    step_s = planner.branch_step_s(cost, 16)
    for rows in (16, 64, 144):
        assert step_s(rows) == pytest.approx(branch_forward_s(rows))
    plan = planner.plan(16, 5)
    assert (plan.branches, plan.steps) == (9, 5)
    # the plan fits the verification under the branch steps' real cost, and one more branch would not;
    # costed like request rows, 3 would have fitted
    glue = cost.step_s(16)
    assert glue + 5 * branch_forward_s(16 * 9) <= PLAN_SAFETY * 1.0 < glue + 5 * branch_forward_s(16 * 10)
    assert glue + 5 * cost.step_s(16 * 3) <= PLAN_SAFETY * 1.0 < glue + 5 * cost.step_s(16 * 4)
    # a branch step of its own (batch 1) is costed from its own request's row
    assert planner.branch_step_s(cost, 1)(8) == pytest.approx(_request_forward_s(1) + 0.008 + 0.0007 * 7)


def test_cost_fits_are_kept_until_their_samples_change():
    """A round asks for the cost models several times between forwards (plan, pays, backups, depth): the
    fits are reused while their samples are the same, and redone when a forward is recorded or the samples
    are replaced."""
    planner = RoundPlanner({})
    for rows in (1, 4, 16):
        planner.record_forward(rows, _request_forward_s(rows))
    for rows in (48, 80, 128):
        planner.record_forward(rows, _request_forward_s(16) + 0.0007 * (rows - 16), parents=16)
    cost = planner.cost_model()
    assert planner.cost_model() is cost and planner.branch_step_s(cost, 16)(64) == planner.branch_step_s(cost, 16)(64)
    planner.record_forward(8, _request_forward_s(8) + 0.005)  # a new sample: a new fit
    assert planner.cost_model() is not cost and planner.cost_model() != cost
    planner.costs.clear()
    planner.costs.extend([(1, 1, 0.010), (2, 2, 0.011), (4, 4, 0.013)])  # replaced: fitted again
    assert planner.cost_model().step_s(1) == pytest.approx(0.010)
    before = planner.branch_step_s(planner.cost_model(), 16)(64)
    planner.record_forward(64, 0.5, parents=16)  # a slow branch step moves the branch fit
    assert planner.branch_step_s(planner.cost_model(), 16)(64) > before
