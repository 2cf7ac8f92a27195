"""Temperature > 0 exactness of the Saguaro proposer: the output distribution of positions 1..4 (and the
joint of two positions) equals the non-speculative engine's, for plain sampling and for top-k/top-p, in a
batch that also holds greedy requests; in `mode: async` for every path that supplies a draft token (hits,
jit and n-gram misses, Saguaro sampling with a fixed and an online C, branches forked and grown across
drafter KV block edges, cut-short branches topped up); and the same check fails when the proposal
probabilities handed to vLLM's rejection sampler are wrong (so it can detect a biased path)."""
from __future__ import annotations

import pytest

from distribution import BIASED_P, EXACT_P, build_tiny_pair, compare, sample_outputs

pytestmark = pytest.mark.engine

K = 3
N = 2000
#: Output tokens of the plain run and of the block-edge run: with a prompt of 5 tokens and a drafter KV
#: block of 8, contexts grow from 5 to 17 tokens, past two block edges (8 and 16).
LONG = 12
VARIANTS = {
    "t1": {"temperature": 1.0},
    "tktp": {"temperature": 0.8, "top_k": 6, "top_p": 0.9},
    "greedy": {"temperature": 0.0},
}
PLAIN_VARIANTS = {**VARIANTS, "tp": {"temperature": 1.0, "top_p": 0.9}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("dist-pair"))


@pytest.fixture(scope="module")
def plain(pair):
    # LONG tokens per sample: the 5-token runs compare its first positions, the block-edge run all of them.
    return sample_outputs(pair[0], variants=PLAIN_VARIANTS, num_samples=N, max_tokens=LONG)


@pytest.fixture(scope="module")
def saguaro(pair):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K, "saguaro": {"mode": "sync"}}
    return sample_outputs(pair[0], speculative_config=spec, variants=VARIANTS, num_samples=N, seed=1)


@pytest.mark.parametrize("variant", ["t1", "tktp"])
def test_saguaro_sampling_matches_target_distribution(plain, saguaro, variant):
    pvalues = compare(plain.tokens[variant], saguaro.tokens[variant])
    assert min(pvalues.values()) > EXACT_P, pvalues
    assert saguaro.spec.drafts > 0 and saguaro.spec.accepted > 0
    assert saguaro.spec.accepted < saguaro.spec.draft_tokens  # rejections happened too
    assert saguaro.shortcuts.get("draft_probs_view", 0) > 0, saguaro.shortcuts  # q read in place, not copied


def _greedy_prefix(plain, run):
    """The plain engine's greedy output (one row: greedy is deterministic), cut to `run`'s length."""
    return plain.tokens["greedy"][0, : run.tokens["greedy"].shape[1]]


def test_greedy_rows_in_a_sampled_batch_stay_greedy(plain, saguaro):
    assert (saguaro.tokens["greedy"] == _greedy_prefix(plain, saguaro)).all()
    assert saguaro.spec.drafts > 0 and saguaro.spec.accepted > 0


def _assert_broken_proposer_detected(pair, plain, proposer: str, spec: dict, seed: int) -> None:
    """Run a deliberately broken proposer (tests/saguaro_test_proposers.py) with the Saguaro options that
    `spec` resolves to, and check that the distribution test rejects it although speculation happened."""
    from vllm.engine.arg_utils import EngineArgs

    resolved = EngineArgs(model=str(pair[0]), speculative_config=spec, skip_tokenizer_init=True,
                          max_model_len=64).create_engine_config().additional_config
    wrong = sample_outputs(pair[0], variants={"t1": VARIANTS["t1"]}, num_samples=N, seed=seed,
                           speculative_config={"method": "custom_class", "num_speculative_tokens": K,
                                               "model": f"saguaro_test_proposers.{proposer}"},
                           engine_kwargs={"additional_config": resolved})
    assert wrong.spec.drafts > 0 and wrong.spec.accepted > 0
    pvalues = compare(plain.tokens["t1"], wrong.tokens["t1"])
    assert min(pvalues.values()) < BIASED_P, pvalues


def test_check_detects_wrong_proposal_probabilities(pair, plain):
    spec = {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K, "saguaro": {"mode": "sync"}}
    _assert_broken_proposer_detected(pair, plain, "WrongProbsProposer", spec, seed=2)


# ------------------------------------------------------------------------------ mode async (SSD)
# Every path that can produce a draft token at temperature > 0, each with its own engine run.

def _ssd(pair, **options):
    return {"method": "saguaro", "model": str(pair[1]), "num_speculative_tokens": K,
            "saguaro": {"mode": "async", **options}}


def _run_ssd(pair, variants, seed, num_samples=N, max_tokens=5, **options):
    return sample_outputs(pair[0], speculative_config=_ssd(pair, **options), variants=variants,
                          num_samples=num_samples, seed=seed, max_tokens=max_tokens)


def _counter(run, name: str) -> float:
    """Sum over labels of a Saguaro Prometheus counter at the end of the run."""
    return sum(v for k, v in run.saguaro.items() if k.split("{")[0] == f"vllm:saguaro_{name}_total")


@pytest.fixture(scope="module")
def ssd_all_hit(pair):
    # Every bonus token of every depth pre-drafted and finished before the answer: every lookup of a
    # derivable outcome hits. 93 branches per request make this the suite's slowest engine run (~90 s of
    # drafting at N), so it draws half the samples; the two-sample test compares them with the plain run's N.
    return _run_ssd(pair, {"t1": VARIANTS["t1"]}, 3, num_samples=N // 2, fanout=[23, 23, 23, 24],
                    finish_predraft=True)


@pytest.fixture(scope="module")
def ssd_jit(pair):
    # One branch per request: mostly misses answered just in time; Saguaro sampling C = 0.25 on every
    # sampled draft (branches and backups); top-p 0.9 and greedy rows in the same batch.
    variants = {"t1": VARIANTS["t1"], "tp": PLAIN_VARIANTS["tp"], "greedy": VARIANTS["greedy"]}
    return _run_ssd(pair, variants, 4, fanout_budget=1, backup="jit", sampling_scale=0.25)


@pytest.fixture(scope="module")
def ssd_ngram(pair):
    # n-gram backups on every miss (deterministic drafts of sampled requests, verified one-hot).
    return _run_ssd(pair, {"tktp": VARIANTS["tktp"]}, 5, fanout_budget=1, backup="ngram")


@pytest.fixture(scope="module")
def ssd_long(pair):
    # LONG tokens with a drafter KV block of 8 tokens: the branches fork inside a block (its filled part is
    # copied) and grow past block edges. Pre-drafts are not finished before the answer, so a hit is often a
    # branch cut short, topped up on the critical path. C is chosen online per round ("auto", arms
    # 1/0.75/0.5/0.25) and scales the top F+1 tokens ("fanout+1").
    return _run_ssd(pair, {"t1": VARIANTS["t1"]}, 7, max_tokens=LONG, fanout=[2, 2, 2, 2], block_size=8,
                    sampling_scale="auto", sampling_scale_tokens="fanout+1")


def _assert_same(plain_tokens, run_tokens, **positions):
    pvalues = compare(plain_tokens, run_tokens, **positions)
    assert min(pvalues.values()) > EXACT_P, pvalues


def test_ssd_all_hits_match_target_distribution(plain, ssd_all_hit):
    _assert_same(plain.tokens["t1"], ssd_all_hit.tokens["t1"])
    s = ssd_all_hit.saguaro
    lookups, hits = _counter(ssd_all_hit, "cache_lookups"), _counter(ssd_all_hit, "cache_hits")
    # Committed tokens that are not one outcome (depth "none", e.g. a step cut at max_tokens) cannot be
    # pre-drafted; every other lookup must hit, and no candidate may have been left out.
    unmatched = s.get('vllm:saguaro_cache_lookups_total{depth="none"}', 0.0)
    shown = {k.replace("vllm:saguaro_", ""): v for k, v in s.items()
             if "_total" in k and ("hits" in k or "dropped" in k or "backups" in k)}
    assert lookups > 0 and hits == lookups - unmatched and unmatched < 0.01 * lookups, shown
    assert s.get("vllm:saguaro_branches_dropped_total", 0.0) == 0, shown
    assert 0 < ssd_all_hit.spec.accepted < ssd_all_hit.spec.draft_tokens
    assert ssd_all_hit.shortcuts.get("draft_probs_view", 0) > 0, ssd_all_hit.shortcuts


@pytest.mark.parametrize("variant", ["t1", "tp"])
def test_ssd_jit_misses_and_saguaro_sampling_match_target_distribution(plain, ssd_jit, variant):
    _assert_same(plain.tokens[variant], ssd_jit.tokens[variant])
    assert _counter(ssd_jit, "cache_hits") > 0, ssd_jit.saguaro
    assert ssd_jit.saguaro.get('vllm:saguaro_backups_total{kind="jit"}', 0) > 0, ssd_jit.saguaro
    assert 0 < ssd_jit.spec.accepted < ssd_jit.spec.draft_tokens


def test_ssd_greedy_rows_stay_greedy(plain, ssd_jit):
    assert (ssd_jit.tokens["greedy"] == _greedy_prefix(plain, ssd_jit)).all()
    assert ssd_jit.spec.drafts > 0 and ssd_jit.spec.accepted > 0 and _counter(ssd_jit, "cache_hits") > 0


def test_ssd_ngram_misses_match_target_distribution(plain, ssd_ngram):
    _assert_same(plain.tokens["tktp"], ssd_ngram.tokens["tktp"])
    assert ssd_ngram.saguaro.get('vllm:saguaro_backups_total{kind="ngram"}', 0) > 0, ssd_ngram.saguaro
    assert _counter(ssd_ngram, "cache_hits") > 0 and ssd_ngram.spec.accepted > 0


def test_check_detects_biased_backup_verification(pair, plain):
    """n-gram backups verified as if drawn from a uniform proposal instead of one-hot: a biased path."""
    _assert_broken_proposer_detected(pair, plain, "UniformBackupProbsProposer",
                                     _ssd(pair, fanout_budget=1, backup="ngram"), seed=6)


def test_ssd_block_edges_topups_and_online_c_match_target_distribution(plain, ssd_long):
    # Positions past the first block edge (output 3 is context position 8) and the second (output 11).
    _assert_same(plain.tokens["t1"], ssd_long.tokens["t1"], positions=(1, 2, 3, 4, 7, 11),
                 joints=((2, 3), (10, 11)))
    s = ssd_long.saguaro
    shown = {k.replace("vllm:saguaro_", ""): v for k, v in s.items() if "_total" in k}
    hits = _counter(ssd_long, "cache_hits")
    sampled = _counter(ssd_long, "sampled_drafts")
    scaled = s.get('vllm:saguaro_sampled_drafts_total{scaled="true"}', 0.0)
    # Each path carries a share of the run large enough for a bias on it to show in the test above.
    assert s.get('vllm:saguaro_branch_blocks_total{kind="fork_copy"}', 0) > 0.1 * hits, shown
    assert s.get('vllm:saguaro_branch_blocks_total{kind="growth"}', 0) > 0.1 * hits, shown
    assert _counter(ssd_long, "topups") > 0.05 * hits > 0, shown
    # The online choice used scaled arms (C < 1) for a good part of the sampled drafts, and C = 1 too.
    assert 0.2 * sampled < scaled < sampled, shown
    assert 0 < ssd_long.spec.accepted < ssd_long.spec.draft_tokens
