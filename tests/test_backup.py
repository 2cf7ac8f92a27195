"""Backups on a speculation-cache miss: the n-gram lookup and the rule that picks jit or n-gram per step."""
from __future__ import annotations

import pytest

from saguaro_vllm.drafter.backup import BackupInputs, choose_backup, expected_tokens, ngram_drafts


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


def _inputs(**kw):
    base = dict(hits=0, misses=1, k=5, alpha_neural=0.8, tokens_ngram=1.1, verify_s=0.1, jit_s=0.05)
    return BackupInputs(**{**base, **kw})


def test_fixed_policies_and_unknown_timings():
    assert choose_backup("jit", _inputs(jit_s=10.0)) == "jit"
    assert choose_backup("ngram", _inputs(jit_s=0.0)) == "ngram"
    assert choose_backup("auto", _inputs(verify_s=None)) == "jit"  # nothing measured yet
    assert choose_backup("auto", _inputs(misses=0)) == "jit"
    with pytest.raises(ValueError, match="unknown backup policy"):
        choose_backup("random", _inputs())


def test_auto_prefers_jit_when_drafting_is_cheap_and_ngram_when_one_miss_stalls_a_big_batch():
    # Batch 1: a 50 ms jit draft for E=3.69 tokens instead of ~1.1 beats verifying n-gram drafts.
    assert choose_backup("auto", _inputs()) == "jit"
    # Batch 16 with one miss: the jit draft stalls 15 hit rows; n-gram keeps them going.
    assert choose_backup("auto", _inputs(hits=15, misses=1, jit_s=0.08)) == "ngram"
    # Drafting slower than verification: n-gram.
    assert choose_backup("auto", _inputs(jit_s=0.5)) == "ngram"
    # A context where n-gram drafts are accepted as often as neural ones: n-gram (free).
    assert choose_backup("auto", _inputs(tokens_ngram=expected_tokens(0.8, 5))) == "ngram"


def test_auto_rule_is_the_throughput_comparison():
    x = _inputs(hits=3, misses=2, verify_s=0.2, jit_s=0.1)
    e_jit, e_ng = expected_tokens(0.8, 5), 1.1
    with_jit = 5 * e_jit / 0.3
    with_ngram = (3 * e_jit + 2 * e_ng) / 0.2
    assert choose_backup("auto", x) == ("jit" if with_jit >= with_ngram else "ngram")
