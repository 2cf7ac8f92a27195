"""The online depth choice (`depth: "auto"`): the pure policy against synthetic verification costs, and the
drafter returning that many drafts per row (still the draft model's own continuation)."""
from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import saguaro_vllm.drafter.depth_choice as depth_module
from saguaro_vllm.drafter.backup import expected_tokens
from saguaro_vllm.drafter.depth_choice import EXPLORE_EVERY, DepthChoice, depth_rate
from saguaro_vllm.drafter.predictor import StepCostModel

DRAFT = StepCostModel(0.01, 0.001)


def test_doctests():
    assert doctest.testmod(depth_module).failed == 0


def _learn(choice: DepthChoice, verify: StepCostModel, batch: int, alpha: float, hit_rate: float,
           steps: int = 200, predraft_steps: int = 8) -> list[int]:
    """Run `steps` rounds: each verifies batch x (1 + the depth chosen) tokens at the cost `verify`."""
    depths = []
    for _ in range(steps):
        d = choice.choose(batch, alpha, DRAFT, {e: (hit_rate, predraft_steps) for e in range(1, choice.k_max + 1)})
        depths.append(d)
        choice.observe(batch * (1 + d), verify.step_s(batch * (1 + d)))
    return depths


def test_flat_verification_and_high_acceptance_go_to_the_maximum():
    choice = DepthChoice(8, start=5)
    depths = _learn(choice, StepCostModel(0.1, 0.0), batch=1, alpha=0.9, hit_rate=1.0)
    assert choice.depth == 8 and depths[-20:].count(8) >= 17
    assert choice.explored()  # the slope was measured (from exploring steps), not assumed


def test_costly_verified_tokens_and_low_acceptance_stay_shallow():
    choice = DepthChoice(8)
    _learn(choice, StepCostModel(0.1, 0.03), batch=1, alpha=0.5, hit_rate=1.0)
    best = max(range(1, 9), key=lambda d: depth_rate(d, 1, 0.5, 1.0, 8, StepCostModel(0.1, 0.03), DRAFT))
    assert choice.depth == best < 5


@pytest.mark.parametrize("predraft_steps", [2, 8])
def test_the_choice_is_the_best_estimated_depth(predraft_steps):
    verify = StepCostModel(0.08, 0.004)
    choice = DepthChoice(8, start=1)
    _learn(choice, verify, batch=4, alpha=0.8, hit_rate=0.7, predraft_steps=predraft_steps)
    rates = {d: depth_rate(d, 4, 0.8, 0.7, predraft_steps, verify, DRAFT) for d in range(1, 9)}
    assert rates[choice.depth] >= max(rates.values()) / depth_module.HYSTERESIS
    # Hits that must be topped up on the critical path (a pre-draft 2 steps deep) make depth cost more.
    if predraft_steps == 2:
        deep = max(rates, key=rates.get)
        assert deep < max(range(1, 9), key=lambda d: depth_rate(d, 4, 0.8, 0.7, 8, verify, DRAFT))


def test_depth_rate_is_tokens_over_verification_and_drafting():
    verify = StepCostModel(0.1, 0.01)
    # Batch 2, depth 3, hit rate 0.5, pre-draft 1 step deep: hits top up 2, misses draft 3 forwards.
    expect = expected_tokens(0.7, 3) / (verify.step_s(2 * 4) + (0.5 * 2 + 0.5 * 3) * DRAFT.step_s(2))
    assert depth_rate(3, 2, 0.7, 0.5, 1, verify, DRAFT) == pytest.approx(expect)


def test_exploring_steps_only_until_three_token_counts_are_measured():
    choice = DepthChoice(6, start=4)
    for step in range(1, 6 * EXPLORE_EVERY + 1):
        was_explored = choice.explored()
        d = choice.choose(1, 0.8, DRAFT, dict.fromkeys(range(1, 7), (1.0, 6)))
        if step % EXPLORE_EVERY == 0 and not was_explored:
            assert d != choice.depth  # one step at another depth; the choice itself is unchanged
        else:
            assert d == choice.depth
        choice.observe(1 + d, 0.1 + 0.002 * d)
    assert choice.explored()
    with pytest.raises(ValueError):
        DepthChoice(0)


def test_ssd_drafter_returns_the_chosen_depth(tiny_pair):
    """The drafter with `depth: "auto"` and K = 6: its answers have at most the chosen depth per row (the
    `depth` it reports), at least one step uses fewer than K, and every draft is the draft model's greedy
    continuation."""
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest
    from test_ssd_drafter import greedy_continuation, make_drafter, simulate_outcome

    model = load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")
    drafter = make_drafter(model, depth="auto", fanout=[1, 1, 1, 1, 1, 1, 1])
    rng = np.random.default_rng(2)
    ctx = list(map(int, rng.integers(2, 300, 20)))
    sent, depths = 0, []
    for step in range(1, 3 * EXPLORE_EVERY + 2):
        row = RowUpdate("a", sent, ctx[sent:], 6, SamplingSpec() if sent == 0 else None)
        sent = len(ctx)
        resp = drafter.step(StepRequest(step, [row], []))
        drafter.answered()
        while drafter.busy:
            drafter.advance()
        d = resp.ssd["depth"]
        depths.append(d)
        assert 1 <= d <= 6 and len(resp.drafts[0]) <= d
        assert resp.drafts[0] == greedy_continuation(model, ctx, len(resp.drafts[0]))
        ctx = ctx + simulate_outcome(model, ctx, resp.drafts[0], rng)
    assert min(depths) < 6, depths
