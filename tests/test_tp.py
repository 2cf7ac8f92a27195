"""Tensor parallelism (TP=2 on the CPU backend) at vocabulary 128256: Saguaro is exact and every rank keeps the
same tokens.

Every TP rank runs vLLM's rejection sampler itself, but only rank 0 has Saguaro's proposal probabilities q;
`patches/tp_sampling.py` makes rank 0's result the one all ranks keep. Checked here with real engines
(two worker processes, `mp` executor, ranks bound `0|1`, the drafter sharing a core: `share_cores`) on the
peaked 128256-token pair of real_vocab.py, against the plain TP=1 engine's run that tests/test_real_vocab.py
compares with too (conftest.py's `plain128k`: the same `b64` and `t1` jobs), in `sync` and `async` (with
`depth: "auto"`, so rows get different draft lengths step by step, and `fallback: "off"`, as there):
- greedy output (64 prompts in one batch) equals the non-speculative engine's, drafts accepted, and every
  rank verified every step by argmax on `greedy_rejection.py`'s fast path, without a broadcast;
- the T=1 output distribution equals plain TP=1 vLLM's, with each rank's path asserted step by step
  (verify_trace.py): rank 0 verified the sampled drafts against q and sent its tokens, rank 1 verified the
  same drafts one-hot and received them, in the same steps (`patches.TP_RANK0_TOKEN_STEPS` on each rank);
  some of rank 1's own results differed and were replaced; drafts accepted and rejected; in `async`, cache
  hits and misses on rank 0, and the steps whose drafts were all n-gram backups (no q: rank 0 verifies them
  one-hot too) shown to be just that;
- after T=1 runs (unseeded and seeded) every rank holds the same committed tokens for every request, and
  they are what the engine returned. (Without the patch every sampled request differs between ranks.)
At this vocabulary the ranks' embedding shards split the vocabulary at 64128 and both halves matter: 17 of the
model's 32 live tokens and some prompt tokens (vocab-3, 64128) lie in rank 1's half. A rank that kept other
tokens would feed other ids to its shard of the embedding, whose all-reduce every rank's hidden states come
from, so the outputs would change too (with the 24-token models this file used before, the whole vocabulary
lay in rank 0's shard and only the direct rank check could see a divergence; it still runs here).
"""
from __future__ import annotations

import numpy as np
import pytest

from distribution import EXACT_P, compare
from engine_runs import Job
from real_vocab import greedy_jobs, t1_job
from tp_engine import run_tp_engine
from verify_trace import totals

pytestmark = pytest.mark.engine

K = 3
VOCAB = 128256
(B64,) = [j for j in greedy_jobs(VOCAB) if j.name == "b64"]
T1 = t1_job(VOCAB)
SEEDED = Job("seeded", [[5, 17, VOCAB - 3, 101, 9], [VOCAB - 7, 64127, 64128, 3]] * 24,
             [{"temperature": 1.0, "max_tokens": 16, "seed": 100 + i} for i in range(48)])
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_num_seqs": 64}


def _saguaro_tp2(pair, mode: str, seed: int, **options):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K,
            "saguaro": {"mode": mode, "share_cores": True, **options}}
    return run_tp_engine(pair[0], [B64, T1, SEEDED], speculative_config=spec, engine_kwargs=TP2, seed=seed)


@pytest.fixture(scope="module")
def sync_tp2(pair128k):
    return _saguaro_tp2(pair128k, "sync", seed=1)


@pytest.fixture(scope="module")
def async_tp2(pair128k):
    return _saguaro_tp2(pair128k, "async", seed=2, depth="auto", fallback="off")


def _steps(rank) -> list[tuple[int, int, int]]:
    return [(s.batch, s.drafted, s.draft_tokens) for s in rank.steps]


def _nonzero(counts: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in counts.items() if v}


def _assert_sampled_rank_paths(job, mode: str) -> None:
    """Rank 0 verified the sampled drafts against q and sent its tokens; rank 1 verified the same drafts one-hot
    and received them, in the same steps, and some of its own results differed."""
    rank0, rank1 = job.ranks
    assert _steps(rank0) == _steps(rank1)  # the same verification steps, rows and drafts on both ranks
    n = len(rank0.steps)
    assert n > 0 and rank1.paths() == {"onehot": n}, rank1.paths()
    assert _nonzero(rank0.rank0_tokens) == {"sent": n} and _nonzero(rank1.rank0_tokens) == {"received": n}
    t0, t1 = totals(rank0.steps), totals(rank1.steps)
    assert t0["replaced"] == 0 and t1["replaced"] > 0, (t0, t1)  # rank 1's own tokens differed in some rows
    assert (t0["accepted"], t0["rejected"]) == (t1["accepted"], t1["rejected"])  # both kept rank 0's
    assert 0 < t0["accepted"] < t0["draft_tokens"] and t0["rejected"] > 0, t0
    if mode == "sync":
        assert rank0.paths() == {"q": n}, rank0.paths()
        return
    # async: a step whose drafted rows all got n-gram drafts (deterministic) comes without q and rank 0 verifies
    # it one-hot too, exactly; then rank 1's own result is rank 0's. Every other step: q, sampled drafts.
    assert rank0.paths().get("q", 0) > 0, rank0.paths()
    for s0, s1 in zip(rank0.steps, rank1.steps):
        if s0.path == "q":
            assert s0.sampled > 0, s0
        else:
            assert s0.path == "onehot" and s0.sampled == 0 and s0.ngram > 0 and s1.replaced == 0, (s0, s1)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tp2_greedy_equals_non_speculative_output(request, plain128k, mode):
    runs, _ = request.getfixturevalue(f"{mode}_tp2")
    job = runs["b64"]
    assert job.token_ids == plain128k["b64"].token_ids
    assert job.spec.drafts > 0 and job.spec.accepted > 0, job.spec
    rank0, rank1 = job.ranks
    assert _steps(rank0) == _steps(rank1)
    for rank in (rank0, rank1):
        n = len(rank.steps)
        assert n > 0 and rank.paths() == {"greedy": n}, rank.paths()
        assert rank.shortcuts.get("greedy_rejection", 0) == n  # every step on the fast path, on every rank
        assert not _nonzero(rank.rank0_tokens) and totals(rank.steps)["replaced"] == 0  # no broadcast needed
        assert totals(rank.steps)["accepted"] > 0
    if mode == "async":
        assert totals(rank0.steps)["hits"] > 0, totals(rank0.steps)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tp2_sampling_matches_plain_tp1_distribution(request, plain128k, mode):
    runs, _ = request.getfixturevalue(f"{mode}_tp2")
    pvalues = compare(np.asarray(plain128k["t1"].token_ids), runs["t1"].tokens, positions=(0, 1, 2, 3, 4),
                      joints=((1, 2),))
    assert min(pvalues.values()) > EXACT_P, pvalues
    job = runs["t1"]
    assert job.spec.drafts > 0 and 0 < job.spec.accepted < job.spec.draft_tokens, job.spec
    _assert_sampled_rank_paths(job, mode)
    if mode == "async":
        t0 = totals(job.ranks[0].steps)
        assert t0["hits"] > 0 and t0["misses"] > 0, t0
        depths = {k: v for k, v in job.saguaro_delta.items()
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
    for job, name in ((T1, "t1"), (SEEDED, "seeded")):
        result = runs[name]
        _assert_sampled_rank_paths(result, mode)
        for rid, prompt, out in zip(result.request_ids, job.prompts, result.token_ids):
            committed = rank0[_engine_ids(rank0, rid)]
            assert committed[: len(prompt) + len(out)] == [*prompt, *out], (name, rid)
