"""DraftModelRunner: every way of feeding tokens gives transformers' logits for the same sequence."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from saguaro_vllm.drafter.kv_cache import KVCacheConfig, OutOfBlocksError  # noqa: E402
from saguaro_vllm.drafter.model import load_draft_model  # noqa: E402
from saguaro_vllm.drafter.runner import DraftModelRunner  # noqa: E402

VOCAB = 300
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU those threads spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny GQA Llama in transformers and the same checkpoint loaded by the drafter."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   vocab_size=VOCAB, max_position_embeddings=512)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_draft_model(path, torch.float32, "cpu")


def hf_last(hf, tokens: list[int], n: int = 1) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -n:]


def make_runner(model, num_blocks=64, block_size=16, **kw) -> DraftModelRunner:
    """A runner whose allocator hands out blocks in random order, so block tables are scattered."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size), **kw)
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(num_blocks)
    random.Random(num_blocks).shuffle(blocks)
    alloc.free(blocks)
    return runner


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_incremental_decode(models):
    hf, model = models
    runner = make_runner(model)
    tokens = seq(24, 1)
    runner.add_request("a")
    out = runner.forward([("a", tokens[:5], 0)])
    torch.testing.assert_close(out, hf_last(hf, tokens[:5]), **TOL)
    for i in range(5, len(tokens)):
        out = runner.forward([("a", tokens[i : i + 1], i)])
        torch.testing.assert_close(out, hf_last(hf, tokens[: i + 1]), **TOL)
    assert runner.num_computed("a") == len(tokens)


@pytest.mark.parametrize("num_logits", [1, 10])
def test_chunked_prefill(models, num_logits):
    """7 tokens per pass: the wanted logits straddle pass boundaries when num_logits=10."""
    hf, model = models
    runner = make_runner(model, block_size=16, max_tokens_per_seq=7)
    tokens = seq(40, 2)
    runner.add_request("a")
    out = runner.forward([("a", tokens, 0)], num_logits=num_logits)
    torch.testing.assert_close(out, hf_last(hf, tokens, num_logits), **TOL)
    out = runner.forward([("a", tokens[:3], 40)], max_tokens_per_seq=2)
    torch.testing.assert_close(out, hf_last(hf, tokens + tokens[:3]), **TOL)


@pytest.mark.parametrize("block_size", [16, 32])
def test_batch_of_different_lengths(models, block_size):
    """Prefills of several lengths in one call, then a mixed call: decodes, a chunk, a new prefill."""
    hf, model = models
    runner = make_runner(model, block_size=block_size)
    seqs = {name: seq(n, i) for i, (name, n) in enumerate({"a": 1, "b": 19, "c": 33, "d": 50}.items())}
    for name in seqs:
        runner.add_request(name)
    out = runner.forward([(name, s, 0) for name, s in seqs.items()])
    torch.testing.assert_close(out, torch.cat([hf_last(hf, s) for s in seqs.values()]), **TOL)

    more = {"a": seq(1, 10), "b": seq(5, 11), "d": seq(1, 12)}
    runner.add_request("e")
    seqs["e"] = seq(21, 13)
    chunks = [(n, t, len(seqs[n])) for n, t in more.items()] + [("e", seqs["e"], 0)]
    for n, t in more.items():
        seqs[n] = seqs[n] + t
    out = runner.forward(chunks)
    expected = torch.cat([hf_last(hf, seqs[n]) for n in ["a", "b", "d", "e"]])
    torch.testing.assert_close(out, expected, **TOL)


def test_truncate_and_refeed(models):
    hf, model = models
    runner = make_runner(model, block_size=16)
    tokens = seq(35, 3)
    runner.add_request("a")
    runner.forward([("a", tokens, 0)])
    free_before = runner.num_free_blocks
    runner.truncate("a", 32)  # 3 blocks -> 2 blocks
    assert runner.num_computed("a") == 32 and runner.num_free_blocks == free_before + 1
    new = [(t + 1) % VOCAB for t in tokens[32:]]
    out = runner.forward([("a", new, 32)], num_logits=3)
    torch.testing.assert_close(out, hf_last(hf, tokens[:32] + new, 3), **TOL)


def test_out_of_blocks_allocates_nothing_and_free_returns_everything(models):
    _, model = models
    runner = make_runner(model, num_blocks=4, block_size=16)
    runner.add_request("a")
    runner.add_request("b")
    runner.forward([("a", seq(40, 4), 0)])  # 3 blocks
    with pytest.raises(OutOfBlocksError):
        runner.forward([("a", seq(1, 5), 40), ("b", seq(20, 6), 0)])  # needs 0 + 2 blocks, 1 free
    assert runner.num_free_blocks == 1 and runner.num_computed("a") == 40
    with pytest.raises(OutOfBlocksError):
        runner.reserve("b", 17)
    runner.reserve("b", 16)  # the caller's pattern: reserve per request, forward those that fit
    runner.forward([("b", seq(16, 6), 0)])
    assert runner.num_free_blocks == 0
    runner.free_request("a")
    runner.free_request("b")
    assert runner.num_free_blocks == 4 and not runner.has_request("a")


def test_misuse_is_reported(models):
    _, model = models
    runner = make_runner(model)
    runner.add_request("a")
    runner.forward([("a", seq(3, 7), 0)])
    with pytest.raises(ValueError, match="starts at 2 but 3 tokens are computed"):
        runner.forward([("a", [1], 2)])
    with pytest.raises(ValueError, match="appears twice"):
        runner.forward([("a", [1], 3), ("a", [2], 3)])
    with pytest.raises(KeyError, match="unknown"):
        runner.forward([("zz", [1], 0)])
    with pytest.raises(ValueError, match="already known"):
        runner.add_request("a")
    with pytest.raises(ValueError, match="cannot truncate to 4"):
        runner.truncate("a", 4)
    assert runner.forward([]).shape == (0, VOCAB)


@pytest.mark.parametrize("block_size", [16, 32])
def test_fused_decode_attention_equals_reference(models, block_size):
    """One-token-per-sequence passes run the compiled branch-attention op; they must give the reference
    loop's logits (sequences of different lengths, shuffled block tables via interleaved growth)."""
    from saguaro_vllm.ops import loader

    assert loader.use_compiled("cpu"), loader.status()  # never a silent fallback in tests
    _, model = models
    rng = random.Random(block_size)
    prompts = {f"s{i}": [rng.randrange(VOCAB) for _ in range(n)] for i, n in enumerate([1, 19, 40, 70])}
    out = {}
    for fused in (True, False):
        runner = DraftModelRunner(model, KVCacheConfig(num_blocks=64, block_size=block_size))
        runner.fused_decode = fused
        for rid in prompts:
            runner.add_request(rid)
        runner.forward([(rid, p, 0) for rid, p in prompts.items()])
        steps = []
        for step in range(5):
            chunks = [(rid, [(step * 7 + i) % VOCAB], runner.num_computed(rid)) for i, rid in enumerate(prompts)]
            steps.append(runner.forward(chunks))
        out[fused] = torch.stack(steps)
    torch.testing.assert_close(out[True], out[False], **TOL)
