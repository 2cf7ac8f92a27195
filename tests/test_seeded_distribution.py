"""Seeded requests: the drafter's noise is independent of the target's, every sample carrying its own
`seed` has the target's distribution, and a seeded request run alone is reproducible in `sync`.

With per-request seeds plain vLLM's output is a function of the seed, so the meaningful distribution test
compares the outputs of N requests seeded 0..N-1 in plain vLLM with the outputs of N requests seeded with
other values in Saguaro: two independent samples of the target's distribution when Saguaro is exact.
"""
from __future__ import annotations

import pytest
import torch

from distribution import EXACT_P, PROMPT, build_tiny_pair, compare
from engine_runs import Job
from saguaro_vllm.drafter.sampling import draft_seed, request_generator
from tp_engine import run_tp_engine

K = 3
N = 2000
SEEDED_PARAMS = {"temperature": 1.0, "max_tokens": 5}
REPEAT = Job("repeat", [list(PROMPT)] * 3, {"temperature": 1.0, "max_tokens": 16, "seed": 7}, sequential=True)


def _seeded(first_seed: int) -> Job:
    return Job("seeded", [list(PROMPT)] * N, [{**SEEDED_PARAMS, "seed": first_seed + i} for i in range(N)])


def test_draft_generator_is_not_the_targets_stream_and_is_reproducible():
    for seed in (0, 1, 7, 2**31 - 1, 2**63 - 1, -5):
        target = torch.empty(64).exponential_(generator=torch.Generator().manual_seed(seed & (2**64 - 1)))
        draft = torch.empty(64).exponential_(generator=request_generator(seed))
        again = torch.empty(64).exponential_(generator=request_generator(seed))
        assert not torch.equal(draft, target) and torch.equal(draft, again)
        assert 0 <= draft_seed(seed) < 2**64 and draft_seed(seed) != seed
    assert len({draft_seed(s) for s in range(1000)}) == 1000
    # A fixed function: seeded drafts stay reproducible across processes, runs and versions.
    assert (draft_seed(0), draft_seed(12345)) == (0x369863ACD9464CF2, 0xECD598F1702011DC)
    unseeded = [torch.empty(8).exponential_(generator=request_generator(None)) for _ in range(2)]
    assert not torch.equal(*unseeded)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("seeded-pair"))


@pytest.fixture(scope="module")
def plain(pair):
    runs, _ = run_tp_engine(pair[0], [_seeded(0)], engine_kwargs={"distributed_executor_backend": "uni"})
    return runs


@pytest.fixture(scope="module")
def saguaro(pair):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K, "saguaro": {"mode": "sync"}}
    runs, _ = run_tp_engine(pair[0], [_seeded(10**6), REPEAT], speculative_config=spec,
                            engine_kwargs={"distributed_executor_backend": "uni"}, seed=1)
    return runs


@pytest.mark.engine
def test_per_request_seeds_keep_the_target_distribution(plain, saguaro):
    pvalues = compare(plain["seeded"].tokens, saguaro["seeded"].tokens)
    assert min(pvalues.values()) > EXACT_P, pvalues
    spec = saguaro["seeded"].spec
    assert spec.drafts > 0 and 0 < spec.accepted < spec.draft_tokens  # accepts and rejections


@pytest.mark.engine
def test_seeded_request_alone_is_reproducible_in_sync_mode(saguaro):
    outs = saguaro["repeat"].token_ids
    assert outs[0] == outs[1] == outs[2], outs
    spec = saguaro["repeat"].spec
    assert spec.drafts > 0 and spec.accepted > 0, spec
