"""Real vocabularies end to end: Llama 3's 128256 tokens and Qwen3's 151936, through vLLM, in `mode: async`
(the default, with `depth: "auto"`) and `mode: sync`.

Every other engine test uses vocabularies of 24 to 4096 tokens; here the drafter's logits, candidate
selection, proposal q' and the proposal ring carry real-sized rows. Greedy outputs equal plain vLLM's at
batch 1 and 64, for a prompt of 3000 tokens, and with `n` = 3 at top-k 1 (sampled rows whose every
completion is the argmax path); at T=1 the output distribution equals plain vLLM's at batch 64 (1000
requests of 5 tokens, 64 in flight: `max_num_seqs`), checked on a peaked target (real_vocab.py) so that a
modest sample has power. The paths are asserted step by step (verify_trace.py): steps of 64 rows whose sampled
drafts were verified against Saguaro's q, with accepts and rejections among those rows, and in `async` cache
hits and misses among them and steps at more than one depth. SSD runs with
`fallback: "off"`: on one CPU core this pair's glue and candidate selection over 128k-token rows cost more
than its verification saves, so the fallback would draft as `sync` does and leave the paths above untested
(the fallback itself: tests/test_e2e_greedy.py, tests/test_fallback.py).

The 128256 pair and the plain engine's run are session fixtures (conftest.py), shared with tests/test_tp.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from distribution import EXACT_P, compare
from engine_runs import run_engine
from real_vocab import ENGINE, build_peaked_pair, greedy_jobs, t1_job
from verify_trace import totals

pytestmark = pytest.mark.engine

K = 4
#: the `t1` job's verification steps of 64 rows with sampled drafts verified against q, and their drafted rows:
#: at least this many (measured: 53-58 steps, 2565-2745 rows over the whole job, ~90 % of them at batch 64)
AT64_MIN_STEPS = 16
AT64_MIN_ROWS = 256


def _jobs(vocab: int, sampled: bool) -> list:
    return [*greedy_jobs(vocab), t1_job(vocab)] if sampled else greedy_jobs(vocab)


def _saguaro(draft, **options) -> dict:
    return {"method": "saguaro", "model": str(draft), "num_speculative_tokens": K, "saguaro": options}


@pytest.fixture(scope="module")
def pair152k(tmp_path_factory):
    return build_peaked_pair(tmp_path_factory.mktemp("vocab-151936"), 151936)


@pytest.fixture(scope="module")
def async128k(pair128k):
    return run_engine(pair128k[0], _jobs(128256, sampled=True), engine_kwargs={**ENGINE, "seed": 1},
                      speculative_config=_saguaro(pair128k[1], mode="async", depth="auto", fallback="off"),
                      trace_verification=True)


@pytest.fixture(scope="module")
def sync128k(pair128k):
    return run_engine(pair128k[0], _jobs(128256, sampled=True), engine_kwargs={**ENGINE, "seed": 2},
                      speculative_config=_saguaro(pair128k[1], mode="sync"), trace_verification=True)


@pytest.fixture(scope="module")
def plain152k(pair152k):
    return run_engine(pair152k[0], _jobs(151936, sampled=False), engine_kwargs={**ENGINE, "seed": 0})


@pytest.fixture(scope="module")
def async152k(pair152k):
    return run_engine(pair152k[0], _jobs(151936, sampled=False), engine_kwargs={**ENGINE, "seed": 1},
                      speculative_config=_saguaro(pair152k[1], mode="async", fallback="off"))


def _assert_greedy_equal(plain, run) -> None:
    for job in ("b1", "b64", "long"):
        assert run[job].token_ids == plain[job].token_ids, job
        assert run[job].spec.drafts > 0 and run[job].spec.accepted > 0, (job, run[job].spec)
    assert run["n3"].completions == plain["n3"].completions
    assert all(c == [c[0]] * 3 for c in run["n3"].completions)
    assert run["n3"].spec.drafts > 0


def _assert_t1_distribution(plain, run, mode: str) -> None:
    """The distribution, then the path: steps of 64 rows whose sampled drafts were verified against q, with
    accepts and rejections among their rows."""
    a, b = (np.asarray(r["t1"].token_ids) for r in (plain, run))
    pvalues = compare(a, b, positions=(0, 1, 2, 3, 4), joints=((1, 2),))
    assert min(pvalues.values()) > EXACT_P, pvalues
    spec = run["t1"].spec
    assert spec.accepted > 0 and spec.accepted < spec.draft_tokens, spec  # accepted and rejected drafts
    (rank,) = run["t1"].ranks
    at64 = totals(rank.select("q", batch=64))
    assert at64["steps"] >= AT64_MIN_STEPS and at64["drafted"] >= AT64_MIN_ROWS, (at64, rank.paths())
    assert 0 < at64["accepted"] < at64["draft_tokens"] and at64["rejected"] > 0, at64
    if mode == "sync":
        assert rank.paths() == {"q": len(rank.steps)}, rank.paths()  # every sampled draft verified against q
        return
    assert at64["hits"] > 0 and at64["misses"] > 0, at64
    for step in rank.steps:  # q for sampled drafts; without q only steps whose drafts are all n-gram ones
        assert (step.path == "q" and step.sampled > 0) or (step.path == "onehot" and step.sampled == 0
                                                            and step.ngram > 0), step


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_greedy_equals_plain_vllm_at_vocab_128256(plain128k, async128k, sync128k, mode):
    run = async128k if mode == "async" else sync128k
    _assert_greedy_equal(plain128k, run)
    if mode == "async":
        hits = sum(run[j].counter("vllm:saguaro_cache_hits") for j in ("b1", "b64", "long"))
        assert hits > 0


def test_greedy_equals_plain_vllm_at_vocab_151936(plain152k, async152k):
    _assert_greedy_equal(plain152k, async152k)
    assert sum(async152k[j].counter("vllm:saguaro_cache_hits") for j in ("b1", "b64")) > 0


def test_async_t1_distribution_at_vocab_128256(plain128k, async128k):
    _assert_t1_distribution(plain128k, async128k, "async")
    t1 = async128k["t1"]
    assert t1.counter("vllm:saguaro_cache_hits") > 0, t1.saguaro_delta
    assert t1.counter("vllm:saguaro_backups") > 0, t1.saguaro_delta  # misses
    assert t1.counter("vllm:saguaro_sampled_drafts") > 0
    depths = {k for k, v in async128k["t1"].saguaro.items()
              if k.startswith("vllm:saguaro_depth_steps_total") and v > 0}
    assert len(depths) >= 2, depths  # depth "auto" used more than one depth


def test_sync_t1_distribution_at_vocab_128256(plain128k, sync128k):
    _assert_t1_distribution(plain128k, sync128k, "sync")


def test_async_gauges_and_histograms_are_exported(async128k):
    """The `mode: async` metrics that only the engine run can fill, read from its process's registry."""
    samples = async128k["t1"].saguaro
    delta = {j: async128k[j].saguaro_delta for j in async128k}
    assert samples["vllm:saguaro_drafter_free_kv_blocks"] > 0
    assert 1 <= samples["vllm:saguaro_draft_depth"] <= K  # depth "auto": the last step's allowed depth
    assert samples["vllm:saguaro_fanout_budget"] >= 1
    assert samples["vllm:saguaro_late_seconds_count"] > 0 and samples["vllm:saguaro_late_seconds_sum"] >= 0
    # the greedy jobs' rows get drafts; the T=1 job's 5-token requests mostly do not (measured: 229 of 2413
    # rows over its last 64 steps: misses whose just-in-time draft does not pay at this vocabulary on one
    # core), and the watch says so
    assert [async128k[j].saguaro["vllm:saguaro_speculating"] for j in ("b1", "b64", "long", "n3")] == [1.0] * 4
    assert samples["vllm:saguaro_speculating"] in (0.0, 1.0)
    assert sum(d.get("vllm:saguaro_predraft_skipped_total", 0) for d in delta.values()) > 0
    # C = 1 (the default): the scale sum is exactly the count of sampled drafts
    sampled = async128k["t1"].counter("vllm:saguaro_sampled_drafts")
    assert sampled > 0 and async128k["t1"].counter("vllm:saguaro_sampled_drafts_scale") == sampled

