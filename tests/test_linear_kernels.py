"""Matmul paths of the drafter's linear layers (`saguaro.linear`): each against plain F.linear, per layer and
for a whole model's logits, the release of packed float weights, and the config checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model import load_draft_model
from saguaro_vllm.drafter.model import linear_kernels
from saguaro_vllm.drafter.model.layers import Linear, MergedLinear
from saguaro_vllm.drafter.model.linear_kernels import (
    EXACT_ROWS,
    install_linear_kernel,
    int8_available,
    onednn_available,
    packed_available,
    padded_rows,
    resolve_linear,
    row_buckets,
    warm_linear_kernels,
)
from saguaro_vllm.drafter.runner import DraftModelRunner

transformers = pytest.importorskip("transformers")

needs_packed = pytest.mark.skipif(not packed_available(), reason="oneDNN packed bf16 linear unavailable (torch build or CPU)")
needs_int8 = pytest.mark.skipif(not int8_available(), reason="torch built without fbgemm")
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="vLLM's CPU GEMM (torch.ops._C.onednn_mm) unavailable")


def _layer(kind: str, bias: bool, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=bias) if kind == "linear" else MergedLinear(96, {"a": 24, "b": 16}, bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(40))
    layer = layer.to(dtype)
    return layer, layer.weight.detach().float().clone(), None if not bias else layer.bias.detach().float().clone()


@pytest.mark.parametrize("kernel,dtype,tol", [
    pytest.param("packed", torch.bfloat16, 2e-2, marks=needs_packed),
    pytest.param("onednn", torch.float32, 1e-5, marks=needs_onednn),
    pytest.param("onednn", torch.bfloat16, 2e-2, marks=needs_onednn),
    pytest.param("int8", torch.bfloat16, 4e-2, marks=needs_int8),
    pytest.param("int8", torch.float32, 4e-2, marks=needs_int8),
])
@pytest.mark.parametrize("kind", ["linear", "merged"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(1,), (7,), (2, 5), (17,), (3, 11), (100,)])  # 17, 33, 100: padded rows
def test_layer_matches_plain_linear(kernel, dtype, tol, kind, bias, rows):
    layer, weight, b = _layer(kind, bias, dtype)
    x = torch.randn(*rows, 96).to(dtype)
    expected = F.linear(x.float(), weight, b)
    assert install_linear_kernel(layer, kernel) == 1
    out = layer(x)
    out = torch.cat(out, dim=-1) if kind == "merged" else out
    assert out.dtype == dtype and out.shape == expected.shape
    scale = expected.abs().max()
    torch.testing.assert_close(out.float() / scale, expected / scale, atol=tol, rtol=0)
    assert layer.weight.numel() == 0  # the packed copy replaced the float weight


def test_row_buckets():
    """Padding bounds the distinct row counts oneDNN sees (one primitive each) at < 12.5 % extra rows."""
    assert [padded_rows(m) for m in (1, EXACT_ROWS, EXACT_ROWS + 1, 100, 1000, 1024, 1025)] == \
        [1, EXACT_ROWS, 18, 104, 1024, 1024, 1152]
    for m in range(1, 5000):
        b = padded_rows(m)
        assert m <= b < 1.125 * m + 1 and padded_rows(b) == b
    buckets = row_buckets(2048)
    assert buckets == sorted(set(padded_rows(m) for m in range(1, 2049)))
    assert len(buckets) == 72


@needs_packed
def test_warm_linear_kernels_builds_buckets_within_budget():
    layers = torch.nn.Sequential(Linear(96, 40, bias=False), MergedLinear(96, {"a": 24, "b": 16}, False),
                                 Linear(40, 96, bias=True)).to(torch.bfloat16)
    install_linear_kernel(layers, "packed")
    assert warm_linear_kernels(layers, 300)[0] == padded_rows(300) == 320
    assert warm_linear_kernels(layers, 300, budget_s=0.0)[0] == 1  # the first bucket, then the budget stops it
    plain = torch.nn.Sequential(Linear(96, 40, bias=False))
    assert warm_linear_kernels(plain, 300) == (0, 0.0)  # nothing pads rows: nothing to build


def test_plain_changes_nothing():
    layer, weight, _ = _layer("linear", True, torch.float32)
    assert install_linear_kernel(layer, "plain") == 0
    assert layer.kernel is None and torch.equal(layer.weight, weight)


def _tiny_checkpoint(path, tie: bool):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=300,
                                   tie_word_embeddings=tie)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _logits(model, tokens):
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=8))
    runner.add_request("r")
    return runner.forward([("r", tokens, 0)], num_logits=len(tokens))


@pytest.mark.parametrize("kernel,tol", [pytest.param("packed", 0.0, marks=needs_packed),
                                        pytest.param("onednn", 0.0, marks=needs_onednn),
                                        pytest.param("int8", 0.1, marks=needs_int8)])
@pytest.mark.parametrize("tie", [False, True])
def test_whole_model_logits(tmp_path, kernel, tol, tie):
    """`packed` computes what plain bf16 computes (the same oneDNN bf16 GEMM, pre-packed); int8 stays close
    and agrees on the argmax of nearly every position. A tied lm_head keeps the embedding's weight."""
    path = _tiny_checkpoint(tmp_path, tie)
    tokens = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = _logits(load_draft_model(path, torch.bfloat16), tokens)
    model = load_draft_model(path, torch.bfloat16)
    assert install_linear_kernel(model, kernel) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert model.model.embed_tokens.weight.numel() == 300 * 128
    out = _logits(model, tokens)
    if tol == 0.0:
        torch.testing.assert_close(out, plain, atol=2e-2, rtol=2e-2)
    else:
        scale = plain.abs().max()
        torch.testing.assert_close(out / scale, plain / scale, atol=tol, rtol=0)
    # 7-bit activations on CPUs without VNNI (linear_kernels._INT8_REDUCE_RANGE) flip more near-ties of
    # this random model's logits
    agree = 0.8 if kernel == "int8" and linear_kernels._INT8_REDUCE_RANGE else 0.9
    assert (out.argmax(-1) == plain.argmax(-1)).float().mean() >= agree


def test_resolve_linear():
    assert resolve_linear("plain", "cpu", "float32") == "plain"
    assert resolve_linear("auto", "cuda:1", "bfloat16") == "plain"
    assert resolve_linear("auto", "cpu", "float32") == ("onednn" if onednn_available() else "plain")
    assert resolve_linear("auto", "cpu", "float16") == "plain"
    assert resolve_linear("auto", "cpu", "bfloat16") == (
        "packed" if packed_available() else "onednn" if onednn_available() else "plain")
    with pytest.raises(ValueError, match="'onednn' needs the drafter on CPU"):
        resolve_linear("onednn", "cuda:0", "float32")
    with pytest.raises(ValueError, match="'packed' needs the drafter on CPU in bfloat16"):
        resolve_linear("packed", "cpu", "float32")
    with pytest.raises(ValueError, match="'int8' needs the drafter on CPU"):
        resolve_linear("int8", "cuda:0", "bfloat16")


def test_config_rejects_unknown_linear():
    with pytest.raises(SaguaroConfigError, match="saguaro.linear"):
        parse_speculative_config({"method": "saguaro", "model": "x", "num_speculative_tokens": 3,
                              "saguaro": {"linear": "fp8"}})[0]
