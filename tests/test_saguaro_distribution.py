"""Temperature > 0 exactness of the Saguaro proposer: the output distribution of positions 2..4 (and the
joint of two positions) equals the non-speculative engine's, for plain sampling and for top-k/top-p, in a
batch that also holds greedy requests; and the same check fails when the proposal probabilities handed to
vLLM's rejection sampler are wrong (so it can detect a biased path)."""
from __future__ import annotations

import pytest

from distribution import build_tiny_pair, compare, sample_outputs

pytestmark = pytest.mark.engine

K = 3
N = 2000
VARIANTS = {
    "t1": {"temperature": 1.0},
    "tktp": {"temperature": 0.8, "top_k": 6, "top_p": 0.9},
    "greedy": {"temperature": 0.0},
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("dist-pair"))


@pytest.fixture(scope="module")
def plain(pair):
    return sample_outputs(pair[0], variants=VARIANTS, num_samples=N)


@pytest.fixture(scope="module")
def saguaro(pair):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K}
    return sample_outputs(pair[0], speculative_config=spec, variants=VARIANTS, num_samples=N, seed=1)


@pytest.mark.parametrize("variant", ["t1", "tktp"])
def test_saguaro_sampling_matches_target_distribution(plain, saguaro, variant):
    pvalues = compare(plain.tokens[variant], saguaro.tokens[variant])
    assert min(pvalues.values()) > 1e-3, pvalues
    assert saguaro.spec.drafts > 0 and saguaro.spec.accepted > 0
    assert saguaro.spec.accepted < saguaro.spec.draft_tokens  # rejections happened too


def test_greedy_rows_in_a_sampled_batch_stay_greedy(plain, saguaro):
    assert (saguaro.tokens["greedy"] == plain.tokens["greedy"][0]).all()


def test_check_detects_wrong_proposal_probabilities(pair, plain):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K}
    resolved = EngineArgs(model=str(pair[0]), speculative_config=spec, skip_tokenizer_init=True,
                          max_model_len=64).create_engine_config().additional_config
    wrong = sample_outputs(pair[0], variants={"t1": VARIANTS["t1"]}, num_samples=N, seed=2,
                           speculative_config={"method": "custom_class", "num_speculative_tokens": K,
                                               "model": "saguaro_test_proposers.WrongProbsProposer"},
                           engine_kwargs={"additional_config": resolved})
    assert wrong.spec.drafts > 0 and wrong.spec.accepted > 0
    pvalues = compare(plain.tokens["t1"], wrong.tokens["t1"])
    assert min(pvalues.values()) < 1e-6, pvalues
