"""Real vocabularies end to end: Llama 3's 128256 tokens and Qwen3's 151936, through vLLM, in `mode: async`
(the default, with `depth: "auto"`) and `mode: sync`.

Every other engine test uses vocabularies of 24 to 4096 tokens; here the drafter's logits, candidate
selection, proposal q' and the proposal ring carry real-sized rows. Greedy outputs equal plain vLLM's at
batch 1 and 64, for a prompt of 3000 tokens, and with `n` = 3 at top-k 1 (sampled rows whose every
completion is the argmax path); at T=1 the output distribution equals plain
vLLM's, checked on a peaked target (below) so that a modest sample has power, with the paths asserted:
drafts accepted and rejected, cache hits and misses, steps at more than one depth. SSD runs with
`fallback: "off"`: on one CPU core this pair's glue and candidate selection over 128k-token rows cost more
than its verification saves, so the fallback would draft as `sync` does and leave the paths above untested
(the fallback itself: tests/test_e2e_greedy.py, tests/test_fallback.py).

The models are tiny random Llamas (2 layers, hidden 64) built here, one pair per vocabulary, shared by the
module's engines. The target is peaked: its LM head is zero except for 32 "live" tokens spread over the whole
vocabulary (ids up to vocab-1), whose logits have a spread of about 6, so a context's best live token takes
about half the probability mass, a few others most of the rest, and the ~128k dead tokens share what is
left (pooled by the chi-square test). The draft is the target with one layer fewer and a perturbed LM head.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from distribution import EXACT_P, build_tiny_llama, compare
from engine_runs import Job, run_engine

pytestmark = pytest.mark.engine

K = 4
LIVE = 32
MAX_MODEL_LEN = 3200
LONG_PROMPT = 3000
SAMPLES = 1000
ENGINE = {"skip_tokenizer_init": True, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 64,
          "enable_prefix_caching": False}


def build_peaked_pair(root: Path, vocab: int) -> tuple[Path, Path]:
    """Target (2 layers) and draft (1 layer, perturbed head) with the peaked LM head described above."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(vocab)
    live = torch.cat([torch.tensor([vocab - 1, vocab - 2, 65535, 65536]),
                      torch.randperm(vocab - 2, generator=gen)[: LIVE - 4]])
    paths = []
    for name, layers, noise in (("target", 2, 0.0), ("draft", 1, 0.6)):
        path = build_tiny_llama(root / name, vocab_size=vocab, num_layers=layers, hidden_size=64, num_heads=2,
                                seed=0, max_positions=MAX_MODEL_LEN + 64)
        file = path / "model.safetensors"
        state = load_file(str(file))
        if name == "target":
            head = torch.randn(vocab, 64, generator=gen) * 0.002  # dead tokens: logits ~ +-0.016, no exact ties
            head[live] = torch.randn(LIVE, 64, generator=gen) * 0.75  # live: |h| = 8 after RMSNorm -> sd ~6
            target_head = head
            target_state = state
        else:  # the target's embedding and first layer, a noisy copy of its head
            state = {k: v for k, v in target_state.items() if ".layers.1." not in k}
            head = target_head.clone()
            head[live] += torch.randn(LIVE, 64, generator=gen) * 0.75 * noise
        state["lm_head.weight"] = head.contiguous()
        save_file(state, str(file), metadata={"format": "pt"})
        paths.append(path)
    return paths[0], paths[1]


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab - 1, length).tolist() for _ in range(n)]


def _jobs(vocab: int, sampled: bool) -> list[Job]:
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    jobs = [
        Job("b1", _prompts(vocab, 2, 12, 1), greedy, sequential=True),
        Job("b64", _prompts(vocab, 64, 10, 2), greedy),
        Job("long", _prompts(vocab, 1, LONG_PROMPT, 3), {**greedy, "max_tokens": 16}),
        # n > 1 needs sampling; top-k 1 makes every completion the argmax path (sampled rows, top-k in q')
        Job("n3", _prompts(vocab, 2, 8, 4), {**greedy, "temperature": 1.0, "top_k": 1, "n": 3}),
    ]
    if sampled:
        jobs.append(Job("t1", [[5, 17, vocab - 3, 101, 9]] * SAMPLES,
                        {"temperature": 1.0, "max_tokens": 5, "ignore_eos": True}))
    return jobs


def _saguaro(draft: Path, **options) -> dict:
    return {"method": "saguaro", "model": str(draft), "num_speculative_tokens": K, "saguaro": options}


@pytest.fixture(scope="module")
def pair128k(tmp_path_factory):
    return build_peaked_pair(tmp_path_factory.mktemp("vocab-128256"), 128256)


@pytest.fixture(scope="module")
def pair152k(tmp_path_factory):
    return build_peaked_pair(tmp_path_factory.mktemp("vocab-151936"), 151936)


@pytest.fixture(scope="module")
def plain128k(pair128k):
    return run_engine(pair128k[0], _jobs(128256, sampled=True), engine_kwargs={**ENGINE, "seed": 0})


@pytest.fixture(scope="module")
def async128k(pair128k):
    return run_engine(pair128k[0], _jobs(128256, sampled=True), engine_kwargs={**ENGINE, "seed": 1},
                      speculative_config=_saguaro(pair128k[1], mode="async", depth="auto", fallback="off"))


@pytest.fixture(scope="module")
def sync128k(pair128k):
    return run_engine(pair128k[0], _jobs(128256, sampled=True), engine_kwargs={**ENGINE, "seed": 2},
                      speculative_config=_saguaro(pair128k[1], mode="sync"))


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


def _assert_t1_distribution(plain, run) -> None:
    a, b = (np.asarray(r["t1"].token_ids) for r in (plain, run))
    pvalues = compare(a, b, positions=(0, 1, 2, 3, 4), joints=((1, 2),))
    assert min(pvalues.values()) > EXACT_P, pvalues
    spec = run["t1"].spec
    assert spec.accepted > 0 and spec.accepted < spec.draft_tokens, spec  # accepted and rejected drafts


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
    _assert_t1_distribution(plain128k, async128k)
    t1 = async128k["t1"]
    assert t1.counter("vllm:saguaro_cache_hits") > 0, t1.saguaro_delta
    assert t1.counter("vllm:saguaro_backups") > 0, t1.saguaro_delta  # misses
    assert t1.counter("vllm:saguaro_sampled_drafts") > 0
    depths = {k for k, v in async128k["t1"].saguaro.items()
              if k.startswith("vllm:saguaro_depth_steps_total") and v > 0}
    assert len(depths) >= 2, depths  # depth "auto" used more than one depth


def test_sync_t1_distribution_at_vocab_128256(plain128k, sync128k):
    _assert_t1_distribution(plain128k, sync128k)


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
