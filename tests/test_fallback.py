"""The pre-draft switch without a model: a round pre-drafts, or leaves its rows to be drafted after the
verification as `sync` does, from measured costs only; the other mode is probed so that the choice follows
the workload (drafter/fallback.py, RoundPlanner.predraft_next)."""
from __future__ import annotations

import pytest

from saguaro_vllm.drafter.fallback import MIN_STEPS, PROBE_EVERY, PROBE_EVERY_MAX, PROBE_ROUNDS, PreDraftSwitch
from saguaro_vllm.drafter.round_planner import RoundPlanner

K, BATCH = 5, 16


def _planner_with_costs(verify_s: float, forward_s: float, glue_s: float) -> RoundPlanner:
    """A planner that measured a verification, draft forwards of the batch's rows and the glue."""
    planner = RoundPlanner({})
    planner.observe_round(verify_s, 0.0, ran_branches=False)
    for _ in range(4):
        planner.record_forward(BATCH, forward_s)
    planner.switch.observe_glue(BATCH, glue_s)
    return planner


def _run_rounds(planner: RoundPlanner, n: int, period_s, glue_s: float | None = None) -> list[bool]:
    """n rounds: each step commits 6 tokens per row in `period_s(predrafted)` seconds (verification and
    answer) and is credited to the mode of the round before it; a round that pre-drafted measured its glue
    (`glue_s`); returns each round's decision."""
    modes = []
    for _ in range(n):
        if planner.predrafted and glue_s is not None:
            planner.switch.observe_glue(BATCH, glue_s)
        verify_s, answer_s = period_s(planner.predrafted)
        planner.end_step(answer_s, BATCH * (K + 1), 0, BATCH, jit=True, all_hit=False,
                         committed=BATCH * (K + 1), verify_s=verify_s)
        modes.append(planner.predraft_next(BATCH, K))
    return modes


def _probe_starts(modes: list[bool]) -> list[int]:
    """The first round of each run of pre-drafting rounds."""
    return [i for i, m in enumerate(modes) if m and (i == 0 or not modes[i - 1])]


def test_glue_beyond_the_verification_means_no_predraft_and_probes_later():
    """The glue alone costs more than the verification: no branch can be ready when the request comes, so
    the plan is "no pre-draft"; PROBE_ROUNDS rounds pre-draft again after PROBE_EVERY rounds, and each probe
    that keeps the fallback doubles the wait for the next, up to PROBE_EVERY_MAX (a probe pre-drafts
    beside the verification and slows it: in a regime where it loses, it costs what it measures)."""
    planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
    gaps = [PROBE_EVERY * 2 ** i for i in range(4)]  # 16, 32, 64, 128 -> capped at 64
    modes = _run_rounds(planner, sum(min(g, PROBE_EVERY_MAX) + PROBE_ROUNDS for g in gaps) + 2,
                        lambda pre: (0.058, 0.1))
    assert modes[0] is False
    assert "glue" in planner.switch.reason and "verification" in planner.switch.reason, planner.switch.reason
    starts = _probe_starts(modes)
    assert sum(modes) == len(starts) * PROBE_ROUNDS == 4 * PROBE_ROUNDS, modes  # whole probes, nothing else
    waits = [b - a - PROBE_ROUNDS + 1 for a, b in zip(starts, starts[1:])]
    assert waits == [2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_EVERY_MAX] == [min(g, PROBE_EVERY_MAX) for g in gaps[1:]]
    assert not planner.switch.predrafting


def test_a_batch_that_changed_since_the_last_probe_is_probed_soon():
    """After a probe that kept the fallback doubled the wait, a batch twice the size of the last probe's is
    probed again PROBE_EVERY rounds after the last probe: its costs are not the ones that probe measured.
    The same batch waits the doubled interval."""
    def rounds_until_probe(batch: int) -> int:
        planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
        modes = _run_rounds(planner, PROBE_EVERY + PROBE_ROUNDS + 1, lambda pre: (0.058, 0.1))
        assert sum(modes) == PROBE_ROUNDS and not modes[-1], modes  # one probe, just over
        for n in range(1, 3 * PROBE_EVERY):
            planner.end_step(0.1, batch * (K + 1), 0, batch, jit=True, all_hit=False,
                             committed=batch * (K + 1), verify_s=0.058)
            if planner.predraft_next(batch, K):
                return n
        return -1

    assert rounds_until_probe(BATCH) == 2 * PROBE_EVERY - 1
    assert rounds_until_probe(2 * BATCH) == rounds_until_probe(BATCH // 2) == PROBE_EVERY - 1


def test_rates_measured_at_another_batch_do_not_decide():
    """Tokens per second grow with the batch: pre-drafting last measured at batch 16 must not look faster
    than `sync` drafting measured at batch 1 (in the regimes matrix each cell's new batch flipped the mode:
    "resumed: pre-drafting steps 277.7 tokens/s, sync drafting 77.5"). A mode's rate counts only near the
    batch it was measured at; a step at a batch 2x apart starts its mode's rate afresh."""
    switch = PreDraftSwitch()
    for _ in range(MIN_STEPS):
        switch.observe_step(True, 16 * 6, 0.10, rows=16)
        switch.observe_step(False, 16 * 6, 0.08, rows=16)
    assert switch.decide(0.05, 0.001, None, batch=16) is False and not switch.predrafting  # sync is faster
    for _ in range(MIN_STEPS):  # the batch drops to 1: `sync` steps now commit ~200 tokens/s
        switch.observe_step(False, 6, 0.03, rows=1)
    assert switch.rate(False, 1) == pytest.approx(200.0) and switch.samples[False] == MIN_STEPS
    assert switch.rate(True, 16) == pytest.approx(960.0) and switch.rate(True, 1) is None
    assert [switch.decide(0.02, 0.001, None, batch=1) for _ in range(PROBE_EVERY - 1)] == [False] * (PROBE_EVERY - 1)
    assert not switch.predrafting and switch.reason.startswith("pre-drafting steps"), switch.reason


def test_predrafting_resumes_when_its_costs_come_back():
    """After the fallback, a probe that finds the glue cheap again (a faster drafter, a longer
    verification) and pre-drafting steps faster than `sync` ones brings pre-drafting back for good."""
    planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
    _run_rounds(planner, 3, lambda pre: (0.058, 0.1))
    assert not planner.switch.predrafting
    # the glue got cheap: pre-drafting steps take the verification and a short answer (hits), sync steps
    # K forwards after it
    modes = _run_rounds(planner, 2 * (PROBE_EVERY + PROBE_ROUNDS) + 10,
                        lambda pre: (0.058, 0.004 if pre else K * 0.02), glue_s=0.004)
    assert planner.switch.predrafting and all(modes[-8:]), modes
    assert "pre-drafting steps" in planner.switch.reason


@pytest.mark.parametrize("lead, resumes", [(1.02, False), (1.10, True)])
def test_a_lead_within_the_margin_keeps_the_fallback(lead, resumes):
    """In the fallback, probes that measure pre-drafting steps a little faster than `sync` ones (within
    RESUME_MARGIN: the noise of the decayed rates) keep it; a lead beyond the margin brings pre-drafting
    back. Without the margin a tie flips the mode after every probe."""
    planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
    _run_rounds(planner, 3, lambda pre: (0.058, 0.1))
    assert not planner.switch.predrafting
    sync_s = 0.058 + 0.1  # pre-drafting steps `lead` times as fast, the glue cheap again
    # probes after 16 rounds (pre-drafting not measured yet: MIN_STEPS), 16 (measured), 32 (doubled)
    modes = _run_rounds(planner, 2 * (PROBE_EVERY + PROBE_ROUNDS) + 2 * PROBE_EVERY + PROBE_ROUNDS,
                        lambda pre: (0.058, sync_s / lead - 0.058 if pre else 0.1), glue_s=0.004)
    assert planner.switch.rate(True) == pytest.approx(lead * planner.switch.rate(False), rel=0.01)
    if not resumes:
        assert not planner.switch.predrafting, modes
        assert sum(modes) == len(_probe_starts(modes)) * PROBE_ROUNDS >= 2 * PROBE_ROUNDS, modes  # probes only
    else:
        cycle = modes[-(PROBE_EVERY + PROBE_ROUNDS):]  # pre-drafting, `sync` probed PROBE_ROUNDS rounds at most
        assert planner.switch.predrafting and sum(cycle) >= PROBE_EVERY, modes


def test_measured_rates_decide_and_the_sync_estimate_stands_in_before_sync_is_measured():
    """The glue fits, but steps after a pre-draft commit fewer tokens per second than the step-cost model
    says `sync` drafting would (lateness eats the saving): fall back on that estimate; later measured
    `sync` steps replace it."""
    planner = _planner_with_costs(verify_s=0.1, forward_s=0.005, glue_s=0.01)
    first = _run_rounds(planner, MIN_STEPS + 1, lambda pre: (0.1, 0.09 if pre else K * 0.005))
    assert first[:MIN_STEPS - 1] == [True] * (MIN_STEPS - 1) and not planner.switch.predrafting
    assert "estimated" in planner.switch.reason
    _run_rounds(planner, 2 * MIN_STEPS, lambda pre: (0.1, 0.09 if pre else K * 0.005))
    assert planner.switch.rate(False) == pytest.approx(BATCH * (K + 1) / (0.1 + K * 0.005))


def test_a_clear_lead_is_not_probed():
    """Pre-drafting far ahead of `sync` (all hits) never spends a round drafting as `sync` does."""
    planner = _planner_with_costs(verify_s=0.1, forward_s=0.02, glue_s=0.005)
    modes = _run_rounds(planner, 3 * PROBE_EVERY, lambda pre: (0.1, 0.002 if pre else K * 0.02))
    assert all(modes)


def test_fixed_plans_and_fallback_off_always_predraft():
    for opts in ({"fallback": "off"}, {"fanout_budget": 8}, {"fanout": [1] * (K + 1)}, {"finish_predraft": True}):
        planner = RoundPlanner(opts)
        planner.observe_round(0.01, 0.0, ran_branches=False)
        for _ in range(4):
            planner.record_forward(BATCH, 0.05)
        planner.switch.observe_glue(BATCH, 0.2)
        assert all(_run_rounds(planner, 20, lambda pre: (0.01, 0.3))), opts


def test_switch_credits_steps_to_their_mode_and_fits_the_glue():
    switch = PreDraftSwitch()
    assert switch.rate(True) is None and switch.glue_s(4) is None
    for _ in range(MIN_STEPS):
        switch.observe_step(True, 10, 0.1)
        switch.observe_step(False, 10, 0.2)
    assert switch.rate(True) == pytest.approx(100.0) and switch.rate(False) == pytest.approx(50.0)
    switch.observe_glue(4, 0.01)
    switch.observe_glue(16, 0.04)
    assert switch.glue_s(8) == pytest.approx(0.02)
    assert switch.decide(None, None, None) is True  # nothing measured: pre-draft


def test_predraft_expected_exactly_before_each_round_that_predrafts():
    """`predraft_expected` (whether a round drafted as `sync` keeps its draft logits for the next glue) is
    true before every round that pre-drafts (the probes included) and false before most fallback rounds."""
    planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
    expected, modes = [], []
    for _ in range(2 * (PROBE_EVERY + PROBE_ROUNDS)):
        expected.append(planner.switch.predraft_expected())
        modes += _run_rounds(planner, 1, lambda pre: (0.058, 0.1), glue_s=0.1)
    assert any(modes[1:]), modes  # probes ran
    assert all(e for e, m in zip(expected[1:], modes[1:]) if m), list(zip(expected, modes))
    fallback = [e for e, m in zip(expected[1:], modes[1:]) if not m]
    assert sum(fallback) <= 4 and len(fallback) > 20, fallback  # ahead of a probe only, not every round


def test_logits_are_not_kept_while_every_round_skips_its_branch_steps():
    """Sampled batches: the glue fits and the switch stays "pre-drafting", but no outcome lies within the
    planned fan-out, so each round skips its branch steps (and its glue) and is drafted as `sync` is. The
    planner then expects no pre-draft (no draft logits kept for a glue) except before the round that runs
    the branch steps anyway."""
    from saguaro_vllm.drafter.round_planner import PROBE_EVERY as SKIP_PROBE

    planner = _planner_with_costs(verify_s=0.1, forward_s=0.005, glue_s=0.01)
    planner.observe_round(0.1, 0.02, ran_branches=True)  # branch steps make the answer wait 20 ms
    expected, modes = [], []
    for _ in range(2 * SKIP_PROBE + 4):
        expected.append(planner.predraft_expected())
        planner.end_step(K * 0.005, BATCH * (K + 1), 0, BATCH, jit=True, all_hit=False, planned=BATCH,
                         covered=0, committed=BATCH * 2, verify_s=0.1)
        modes.append(planner.predraft_next(BATCH, K))
    assert planner.switch.predrafting  # the switch alone would keep the logits every round
    assert sum(modes) <= 3 and not all(modes[-SKIP_PROBE + 1:]), modes  # branch steps skipped, probes aside
    assert all(e for e, m in zip(expected[1:], modes) if m), list(zip(expected, modes))
    skipped = [e for e, m in zip(expected[1:], modes) if not m]
    assert len(skipped) > SKIP_PROBE and sum(skipped) <= 3, list(zip(expected, modes))


def test_a_probe_runs_its_branch_steps_whatever_the_hit_floor_measured_before_the_fallback():
    """The fallback began on stale figures (a cold first glue beyond the verification, after a sampled
    warm-up whose outcomes lay outside the fan-out: a hit floor near 0). Those figures are measured only in
    rounds that pre-draft; a probe that let `branches_pay_off` skip its branch steps on them measured a
    `sync` round and never brought pre-drafting back (regimes, batch 1, T=0, a certain outcome: pre-draft
    share 0.007). The probe runs them, hits, and pre-drafting resumes."""
    planner = _planner_with_costs(verify_s=0.058, forward_s=0.02, glue_s=0.1)
    planner.observe_round(0.058, 0.03, ran_branches=True)  # the warm-up's branch steps made answers wait
    for _ in range(3):  # sampled warm-up rounds: no outcome within the planned fan-out
        planner.end_step(0.1, BATCH * (K + 1), 0, BATCH, jit=True, all_hit=False, planned=BATCH, covered=0)
    assert planner.branch_hit_floor() < 0.1
    modes, probe_rounds = [planner.predraft_next(BATCH, K)], []
    for _ in range(2 * (PROBE_EVERY + PROBE_ROUNDS) + 10):
        if planner.predrafted:  # a certain outcome: every pre-drafted row hits, the answer is immediate
            planner.switch.observe_glue(BATCH, 0.004)
            planner.end_step(0.004, BATCH * (K + 1), BATCH, BATCH, jit=False, all_hit=True, ran_branches=True,
                             planned=BATCH, covered=BATCH, committed=BATCH * (K + 1), verify_s=0.058)
        else:
            planner.end_step(K * 0.02, BATCH * (K + 1), 0, BATCH, jit=True, all_hit=False,
                             committed=BATCH * (K + 1), verify_s=0.058)
        modes.append(planner.predraft_next(BATCH, K))
        if planner.switch.probing and not planner.switch.predrafting:
            probe_rounds.append(modes[-1])
    assert modes[0] is False and probe_rounds, modes  # the stale glue began the fallback; a probe followed
    assert all(probe_rounds), probe_rounds  # every probe round pre-drafted, its branch steps included
    assert planner.switch.predrafting and all(modes[-8:]), modes
