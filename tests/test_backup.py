"""Backups on a speculation-cache miss: the n-gram lookup and the per-row rule that picks which misses and
cut-short hits are drafted on the critical path."""
from __future__ import annotations

import pytest

from saguaro_vllm.drafter.backup import DraftNow, choose_draft_now, draft_now_s, expected_tokens, ngram_drafts, step_rate


@pytest.mark.parametrize(
    ("context", "k", "expected"),
    [
        ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),  # trigram absent, bigram [1, 2] seen at 0
        ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, [9, 2]),  # trigram [1, 2, 3] beats the later bigram [2, 3]
        ([5, 5, 5, 5], 4, [5]),  # latest earlier occurrence, continuation cut at the context's end
        ([5, 6, 7], 2, []),
        ([4], 3, []),
        ([1, 2, 1, 2], 0, []),
    ],
)
def test_ngram_drafts(context, k, expected):
    assert ngram_drafts(context, k) == expected


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


FIXED, PER_ROW = 0.010, 0.001  # a draft forward: 10 ms + 1 ms per row


def _miss(row, gain=2.6, feed=1, steps=5):
    return DraftNow(row, feed, steps, gain)


def test_fixed_policies_and_unknown_timings():
    rows = [_miss(0), DraftNow(1, 1, 2, 0.5, topup=True)]
    assert choose_draft_now(rows, 5.0, 0.1, FIXED, PER_ROW, "jit") == [0, 1]
    assert choose_draft_now(rows, 5.0, 0.1, FIXED, PER_ROW, "ngram") == [1]  # top-ups only
    assert choose_draft_now(rows, 5.0, None, FIXED, PER_ROW) == [0, 1]  # nothing measured yet: as sync
    assert choose_draft_now(rows, 5.0, 0.1, None, None) == [0, 1]
    assert choose_draft_now([], 5.0, 0.1, FIXED, PER_ROW) == []
    with pytest.raises(ValueError, match="unknown backup policy"):
        choose_draft_now(rows, 5.0, 0.1, FIXED, PER_ROW, "random")


def test_draft_now_time_is_the_batched_forwards():
    rows = [_miss(0, feed=30), _miss(1), DraftNow(2, 1, 2, 1.0, topup=True)]
    # 5 forwards; rows fed: 30 + 4, 1 + 4, 1 + 1.
    assert draft_now_s(rows, FIXED, PER_ROW) == pytest.approx(5 * FIXED + 41 * PER_ROW)
    assert draft_now_s([], FIXED, PER_ROW) == 0.0


def test_batch_1_miss_is_drafted_when_drafting_is_cheap_and_left_when_it_is_slow():
    # E(0.8, 5) = 3.69 tokens instead of 1.1 for 55 ms on a 100 ms verification: drafted now.
    assert choose_draft_now([_miss(0)], 1.1, 0.1, FIXED, PER_ROW) == [0]
    # A drafter slower than the target (100 ms a forward): the n-gram drafts are worth more.
    assert choose_draft_now([_miss(0)], 1.1, 0.1, 0.1, PER_ROW) == []


def test_hits_of_a_big_batch_do_not_wait_for_one_miss():
    # 15 hit rows of E = 3.69 and one miss: drafting it now delays 55 tokens by 55 ms for 2.6 more.
    base = 15 * 3.69 + 1.1
    assert choose_draft_now([_miss(3)], base, 0.1, FIXED, PER_ROW) == []
    # The whole batch missing: drafting all of them now pays.
    misses = [_miss(i) for i in range(16)]
    assert choose_draft_now(misses, 16 * 1.1, 0.1, FIXED, PER_ROW) == list(range(16))
    # Scored at a long-run rate instead of the step's own: a row is drafted iff it gains more than the
    # rate times the time it adds.
    assert choose_draft_now([_miss(0)], 1.1, 0.1, FIXED, PER_ROW, rate=2.6 / 0.055 - 1) == [0]
    assert choose_draft_now([_miss(0)], 1.1, 0.1, FIXED, PER_ROW, rate=2.6 / 0.055 + 1) == []


def test_rows_are_chosen_by_gain_per_row_fed():
    # A long uncomputed prefill costs more than it gains; the cheap miss and the top-up are drafted.
    rows = [_miss(0, feed=400), _miss(1), DraftNow(2, 1, 1, 0.6, topup=True)]
    assert choose_draft_now(rows, 3.0, 0.1, FIXED, PER_ROW) == [1, 2]


@pytest.mark.parametrize("seed", range(20))
def test_choice_is_at_least_as_good_as_all_none_and_every_single_row(seed):
    import random

    rng = random.Random(seed)
    rows = [DraftNow(i, rng.randint(1, 50), rng.randint(1, 5), rng.uniform(0.0, 4.0), rng.random() < 0.3)
            for i in range(rng.randint(1, 12))]
    base, verify = rng.uniform(1, 40), rng.uniform(0.02, 0.5)

    def rate(chosen):
        picked = [r for r in rows if r.row in chosen]
        return (base + sum(r.gain for r in picked)) / (verify + draft_now_s(picked, FIXED, PER_ROW))

    best = rate(set(choose_draft_now(rows, base, verify, FIXED, PER_ROW)))
    for other in [set(), {r.row for r in rows}, *({r.row} for r in rows)]:
        assert best >= rate(other) - 1e-12
    # At a given long-run rate, the same for tokens - rate x seconds.
    lam = rng.uniform(5, 400)

    def value(chosen):
        picked = [r for r in rows if r.row in chosen]
        return base + sum(r.gain for r in picked) - lam * (verify + draft_now_s(picked, FIXED, PER_ROW))

    best = value(set(choose_draft_now(rows, base, verify, FIXED, PER_ROW, rate=lam)))
    for other in [set(), {r.row for r in rows}, *({r.row} for r in rows)]:
        assert best >= value(other) - 1e-9


def test_step_rate_is_the_expectation_over_misses():
    # Batch 2, hit rate 0.5, policy jit: P(0, 1, 2 misses) = 1/4, 1/2, 1/4; every miss drafted now.
    e = expected_tokens(0.8, 5)
    t = [0.1, 0.1 + draft_now_s([_miss(0)], FIXED, PER_ROW), 0.1 + draft_now_s([_miss(0), _miss(1)], FIXED, PER_ROW)]
    expect = (2 * e) / (0.25 * t[0] + 0.5 * t[1] + 0.25 * t[2])
    assert step_rate(2, 0.5, 5, 0.8, 1.1, 1, 0.1, FIXED, PER_ROW, "jit") == pytest.approx(expect)
    # n-gram: nothing is drafted now; tokens fall with each miss, time stays the verification.
    expect = (0.25 * 2 * e + 0.5 * (e + 1.1) + 0.25 * 2 * 1.1) / 0.1
    assert step_rate(2, 0.5, 5, 0.8, 1.1, 1, 0.1, FIXED, PER_ROW, "ngram") == pytest.approx(expect)
    # auto is never below either fixed policy.
    for h in (0.0, 0.3, 0.9):
        auto = step_rate(16, h, 5, 0.8, 1.1, 1, 0.1, FIXED, PER_ROW)
        fixed = max(step_rate(16, h, 5, 0.8, 1.1, 1, 0.1, FIXED, PER_ROW, p) for p in ("jit", "ngram"))
        assert auto >= fixed * (1 - 1e-6), (h, auto, fixed)


def test_draft_now_candidates_weigh_misses_hits_and_topups():
    """Row 0 a miss with n-gram drafts, row 1 a miss without, row 2 a hit of 2 drafts cut short (1 more
    wanted), row 3 a row without drafts: gains and the base are the expected-token arithmetic."""
    from saguaro_vllm.drafter.backup import draft_now_candidates, expected_tokens

    a, e_ng = 0.6, 1.5
    cands, base = draft_now_candidates(4, {0: (3, 4, True), 1: (1, 4, False)}, {2: 2}, [(2, 1)], {2: 2}, a, e_ng)
    assert [(c.row, c.feed, c.steps, c.topup) for c in cands] == [(0, 3, 4, False), (1, 1, 4, False), (2, 1, 1, True)]
    assert cands[0].gain == pytest.approx(expected_tokens(a, 4) - e_ng)
    assert cands[1].gain == pytest.approx(expected_tokens(a, 4) - 1.0)
    assert cands[2].gain == pytest.approx(expected_tokens(a, 3) - expected_tokens(a, 2))
    assert base == pytest.approx(e_ng + 1.0 + expected_tokens(a, 2) + 1.0)
