"""Greedy exactness through `vllm.LLM`: Saguaro's output equals the same engine without speculation, token
for token, for a batch of prompts of different lengths and at batch 1, and speculation really happened."""
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


def _jobs():
    return [Job("batch", PROMPTS, GREEDY), Job("batch1", PROMPTS[:4], GREEDY, sequential=True)]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return run_engine(tiny_pair[0], _jobs(), engine_kwargs=ENGINE)


@pytest.fixture(scope="module")
def saguaro(tiny_pair):
    spec = {"method": "saguaro", "model": tiny_pair[1], "num_speculative_tokens": 4,
            "saguaro": {"mode": "sync", "log_interval_s": 1}}
    return run_engine(tiny_pair[0], _jobs(), speculative_config=spec, engine_kwargs=ENGINE)


@pytest.mark.parametrize("job", ["batch", "batch1"])
def test_greedy_output_identical(reference, saguaro, job):
    assert saguaro[job].token_ids == reference[job].token_ids
    assert all(len(t) == GREEDY["max_tokens"] for t in saguaro[job].token_ids)
    spec = saguaro[job].spec
    assert spec.drafts > 0 and spec.draft_tokens > 0, "no speculation happened"
    assert spec.accepted > 0, "no draft token was accepted"
    assert reference[job].spec.drafts == 0


def test_drafter_state_freed_after_requests_finish(saguaro):
    # Requests are freed when vLLM reports them finished (at its next step): after the sequential job,
    # at most its last request is still held, although 14 requests ran.
    held = saguaro["batch1"].saguaro
    assert held["vllm:saguaro_drafter_requests"] <= 1
    assert saguaro["batch"].saguaro["vllm:saguaro_draft_tokens_total"] > 0
