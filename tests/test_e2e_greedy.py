"""Greedy exactness through `vllm.LLM`: Saguaro's output equals the same engine without speculation, token
for token, in `mode: sync` and in `mode: async` (SSD), at batch 1, 4 and 16 with prompts of different
lengths, chunked prefill and continuous batching (requests arriving as others finish), and speculation
really happened: drafts accepted and, in SSD, both speculation-cache hits and misses."""
from __future__ import annotations

import pytest

from engine_runs import Job, run_engine

pytestmark = pytest.mark.engine

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "for i in range(10):\n    print(",
    "import os\nimport sys\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n    def norm(self):",
    "x",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
    "print(os.getcwd(), sys.argv)",
    "return a + b\n" * 6,
    "class",
    # Longer than max_num_batched_tokens: prefilled in chunks, so the proposer sees rows with no sampled
    # tokens (it must return [] for them) while other requests decode.
    "def f(x):\n    return [i * x for i in range(x) if i % 3]\n" * 5,
]
# Small token budget: forces chunked prefill of the long prompt beside decoding requests.
ENGINE = {"max_num_batched_tokens": 96, "max_num_seqs": 16}
GREEDY = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}
# 20 requests of different lengths for 16 sequence slots: the last ones arrive as the first ones finish.
MIXED = [{"temperature": 0.0, "max_tokens": 16 + 9 * (i % 5), "ignore_eos": True} for i in range(20)]


def _jobs():
    return [
        Job("batch", PROMPTS, GREEDY),
        Job("batch1", PROMPTS[:4], GREEDY, sequential=True),
        Job("batch4", PROMPTS[4:8], GREEDY),
        Job("batch16", (PROMPTS * 2)[:20], MIXED),
    ]


def _spec(tiny_pair, mode: str, **options):
    return {"method": "saguaro", "model": tiny_pair[1], "num_speculative_tokens": 4,
            "saguaro": {"mode": mode, "log_interval_s": 1, **options}}


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return run_engine(tiny_pair[0], _jobs(), engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def saguaro(tiny_pair):
    return run_engine(tiny_pair[0], _jobs(), speculative_config=_spec(tiny_pair, "sync"), engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def ssd(tiny_pair):
    # A budget of two branches per request: some outcomes are pre-drafted (hits), most are not (misses).
    return run_engine(tiny_pair[0], _jobs(), speculative_config=_spec(tiny_pair, "async", fanout_budget=2),
                      engine_kwargs=ENGINE)


def _assert_speculated(result):
    spec = result.spec
    assert spec.drafts > 0 and spec.draft_tokens > 0, "no speculation happened"
    assert spec.accepted > 0, "no draft token was accepted"


@pytest.mark.parametrize("job", ["batch", "batch1", "batch4", "batch16"])
def test_greedy_output_identical(reference, saguaro, job):
    assert saguaro[job].token_ids == reference[job].token_ids
    assert [len(t) for t in saguaro[job].token_ids] == [len(t) for t in reference[job].token_ids]
    _assert_speculated(saguaro[job])
    assert reference[job].spec.drafts == 0


@pytest.mark.parametrize("job", ["batch", "batch1", "batch4", "batch16"])
def test_ssd_greedy_output_identical_with_hits_and_misses(reference, ssd, job):
    assert ssd[job].token_ids == reference[job].token_ids
    _assert_speculated(ssd[job])
    hits, lookups = ssd[job].counter("vllm:saguaro_cache_hits"), ssd[job].counter("vllm:saguaro_cache_lookups")
    assert hits > 0, f"no speculation-cache hit: {ssd[job].saguaro_delta}"
    assert lookups - hits > 0, f"no speculation-cache miss: {ssd[job].saguaro_delta}"
    assert ssd[job].counter("vllm:saguaro_backups") == lookups - hits


def test_drafter_state_freed_after_requests_finish(saguaro):
    # Requests are freed when vLLM reports them finished (at its next step): after the sequential job,
    # at most its last request is still held, although 14 requests ran.
    held = saguaro["batch1"].saguaro
    assert held["vllm:saguaro_drafter_requests"] <= 1
    assert saguaro["batch"].saguaro["vllm:saguaro_draft_tokens_total"] > 0


def test_ssd_with_a_drafter_slower_than_the_target(tiny_pair, reference):
    """Every drafter forward delayed by 30 ms (the tiny target verifies in a few ms): pre-drafts are cut
    short and topped up or missed, and the output is still the target's greedy output."""
    jobs = [Job("batch4", PROMPTS[4:8], GREEDY)]
    slow = run_engine(tiny_pair[0], jobs, speculative_config=_spec(tiny_pair, "async"), engine_kwargs=ENGINE,
                      env={"SAGUARO_DRAFTER_DELAY_S": "0.03"})
    assert slow["batch4"].token_ids == reference["batch4"].token_ids
    _assert_speculated(slow["batch4"])
    assert slow["batch4"].counter("vllm:saguaro_cache_lookups") > 0
