"""Tensor parallelism (TP=2 on the CPU backend): Saguaro is exact and every rank keeps the same tokens.

Every TP rank runs vLLM's rejection sampler itself, but only rank 0 has Saguaro's proposal probabilities;
`patches/tp_sampling.py` makes rank 0's result the one all ranks keep. Checked here with real engines
(two worker processes, `mp` executor, ranks bound `0|1`, the drafter sharing a core: `share_cores`):
- greedy output equals the non-speculative engine's, with drafts accepted;
- the T=1 output distribution equals plain TP=1 vLLM's, for `sync` and `async` (with `depth: "auto"`, so
  rows get different draft lengths step by step), with rejections;
- after T=1 runs (unseeded and seeded) every rank holds the same committed tokens for every request, and
  they are what the engine returned. (Without the patch every sampled request differs between ranks.)
The tiny models' vocabulary (24 tokens) lies in rank 0's embedding shard, so a rank that keeps other tokens
does not change the outputs here: the direct rank check is what catches divergence.
"""
from __future__ import annotations

import pytest

from distribution import EXACT_P, PROMPT, build_tiny_pair, compare
from engine_runs import Job
from tp_engine import run_tp_engine

pytestmark = pytest.mark.engine

K = 3
N = 1500
GREEDY_PROMPTS = [list(PROMPT), [2, 9, 4], [3, 3, 8, 1, 6, 6, 2], [11, 5]]
GREEDY = Job("greedy", GREEDY_PROMPTS, {"temperature": 0.0, "max_tokens": 24})
T1 = Job("t1", [list(PROMPT)] * N, {"temperature": 1.0, "max_tokens": 5})
SEEDED = Job("seeded", [list(PROMPT), [2, 9, 4]] * 24,
             [{"temperature": 1.0, "max_tokens": 16, "seed": 100 + i} for i in range(48)])
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("tp-pair"))


@pytest.fixture(scope="module")
def plain(pair):
    runs, _ = run_tp_engine(pair[0], [GREEDY, T1], engine_kwargs={"distributed_executor_backend": "uni"})
    return runs


def _saguaro_tp2(pair, mode: str, jobs: list[Job], seed: int, **options):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K,
            "saguaro": {"mode": mode, "share_cores": True, **options}}
    return run_tp_engine(pair[0], jobs, speculative_config=spec, engine_kwargs=TP2, seed=seed)


@pytest.fixture(scope="module")
def sync_tp2(pair):
    return _saguaro_tp2(pair, "sync", [GREEDY, T1, SEEDED], seed=1)


@pytest.fixture(scope="module")
def async_tp2(pair):
    return _saguaro_tp2(pair, "async", [T1, SEEDED], seed=2, depth="auto")


def test_tp2_greedy_equals_non_speculative_output(plain, sync_tp2):
    runs, _ = sync_tp2
    assert runs["greedy"].token_ids == plain["greedy"].token_ids
    assert runs["greedy"].spec.drafts > 0 and runs["greedy"].spec.accepted > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tp2_sampling_matches_plain_tp1_distribution(request, plain, mode):
    runs, _ = request.getfixturevalue(f"{mode}_tp2")
    pvalues = compare(plain["t1"].tokens, runs["t1"].tokens)
    assert min(pvalues.values()) > EXACT_P, pvalues
    spec = runs["t1"].spec
    assert spec.drafts > 0 and 0 < spec.accepted < spec.draft_tokens  # accepts and rejections
    if mode == "async":
        assert runs["t1"].counter("vllm:saguaro_cache_lookups") > 0, runs["t1"].saguaro_delta
        depths = {k: v for k, v in runs["t1"].saguaro_delta.items()
                  if k.startswith("vllm:saguaro_depth_steps_total{") and v > 0}
        assert len(depths) >= 2, depths  # `depth: "auto"` answered steps at more than one depth


def _engine_ids(rank0: dict[str, list[int]], request_id: str) -> str:
    """The runner's id of the request vLLM returned as `request_id` (the engine may add a suffix)."""
    if request_id in rank0:
        return request_id
    (rid,) = [r for r in rank0 if r.startswith(f"{request_id}-")]
    return rid


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_rank_holds_the_same_tokens_after_sampled_runs(request, mode):
    runs, ranks = request.getfixturevalue(f"{mode}_tp2")
    assert len(ranks) == 2
    rank0, rank1 = ranks
    differing = sorted(rid for rid in set(rank0) | set(rank1) if rank0.get(rid) != rank1.get(rid))
    assert not differing, f"{len(differing)} of {len(rank0)} requests differ between ranks, e.g. " \
                          f"{differing[0]}: {rank0.get(differing[0])} vs {rank1.get(differing[0])}"
    for name in ("t1", "seeded"):
        job = runs[name]
        assert job.spec.drafts > 0 and 0 < job.spec.accepted < job.spec.draft_tokens, (name, job.spec)
        prompts = T1.prompts if name == "t1" else SEEDED.prompts
        for rid, prompt, out in zip(job.request_ids, prompts, job.token_ids):
            committed = rank0[_engine_ids(rank0, rid)]
            assert committed[: len(prompt) + len(out)] == [*prompt, *out], (name, rid)
