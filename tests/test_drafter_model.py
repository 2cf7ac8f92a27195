"""Draft model families and loader: logits equal transformers' on tiny random checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from saguaro_vllm.drafter.kv_cache import KVCacheConfig  # noqa: E402
from saguaro_vllm.drafter.model import load_draft_model, read_model_info  # noqa: E402
from saguaro_vllm.drafter.runner import DraftModelRunner  # noqa: E402

VOCAB = 300
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that all three frequency bands occur
}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-gqa": ("llama", {"num_key_value_heads": 1}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied-gqa": ("qwen3", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU those threads spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_hf_model(family: str, **overrides):
    """A tiny random model; weights are perturbed so that norms and biases are not trivially 1/0."""
    kwargs = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=512)
    kwargs.update(overrides)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def all_logits(path: Path, tokens: list[int], dtype=torch.float32) -> torch.Tensor:
    runner = DraftModelRunner(load_draft_model(path, dtype, "cpu"), KVCacheConfig(num_blocks=8))
    runner.add_request("r")
    return runner.forward([("r", tokens, 0)], num_logits=len(tokens))


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


TOKENS = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    hf = make_hf_model(family, **overrides)
    out = all_logits(save(hf, tmp_path), TOKENS)
    torch.testing.assert_close(out, hf_logits(hf, TOKENS), atol=2e-5, rtol=1e-4)


def test_fused_weights_are_the_checkpoint_projections(tmp_path):
    hf = make_hf_model("llama", num_key_value_heads=1)
    model = load_draft_model(save(hf, tmp_path), torch.float32)
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    qkv = torch.cat([theirs.self_attn.q_proj.weight, theirs.self_attn.k_proj.weight,
                     theirs.self_attn.v_proj.weight])
    gate_up = torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
    assert torch.equal(ours.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(ours.mlp.gate_up_proj.weight, gate_up)


def test_tied_embeddings_share_storage(tmp_path):
    model = load_draft_model(save(make_hf_model("qwen3", tie_word_embeddings=True), tmp_path), torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_old_config_spelling_loads_the_same_model(tmp_path):
    """transformers < 5 writes `rope_theta` + `rope_scaling` instead of `rope_parameters`."""
    hf = make_hf_model("llama", rope_parameters=LLAMA3_ROPE)
    path = save(hf, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(cfg))
    torch.testing.assert_close(all_logits(path, TOKENS), hf_logits(hf, TOKENS), atol=2e-5, rtol=1e-4)


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model("qwen3")
    path = save(hf, tmp_path, max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(all_logits(path, TOKENS), hf_logits(hf, TOKENS), atol=2e-5, rtol=1e-4)


def test_bfloat16_load(tmp_path):
    hf = make_hf_model("llama")
    path = save(hf, tmp_path)
    model = load_draft_model(path, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = all_logits(path, TOKENS, torch.bfloat16)
    ref = hf_logits(hf, TOKENS)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=0)


def test_dtype_by_name(tmp_path):
    model = load_draft_model(save(make_hf_model("llama"), tmp_path), "float16")
    assert model.lm_head.weight.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_matches_transformers(tmp_path, dtype, atol):
    hf = make_hf_model("qwen3", num_key_value_heads=1)
    path = save(hf, tmp_path)
    runner = DraftModelRunner(load_draft_model(path, dtype, "cuda:0"), KVCacheConfig(num_blocks=8))
    runner.add_request("r")
    out = runner.forward([("r", TOKENS, 0)], num_logits=len(TOKENS))
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), hf_logits(hf, TOKENS), atol=atol, rtol=0)


def test_read_model_info(tmp_path):
    info = read_model_info(save(make_hf_model("qwen3", num_key_value_heads=1), tmp_path))
    assert (info.architecture, info.vocab_size, info.num_layers) == ("Qwen3ForCausalLM", VOCAB, 2)
    assert (info.num_heads, info.num_kv_heads, info.head_size) == (2, 1, 64)
    assert info.path == str(tmp_path)


# ---- errors: each names the path and the fix ------------------------------------------------------
def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'nope'}.*not a directory"):
        read_model_info(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} has no config.json"):
        load_draft_model(tmp_path)


def test_missing_weights(tmp_path):
    path = save(make_hf_model("llama"), tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"{tmp_path} has no \\*.safetensors"):
        read_model_info(path)


def test_unsupported_architecture(tmp_path):
    path = save(make_hf_model("llama"), tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=f"{tmp_path}: architecture GPT2LMHeadModel is not supported.*Llama"):
        read_model_info(path)


def test_unsupported_rope(tmp_path):
    path = save(make_hf_model("llama"), tmp_path)
    _edit_config(path, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        read_model_info(path)


@pytest.mark.parametrize("dtype", ["int8", torch.float64])
def test_unsupported_dtype(tmp_path, dtype):
    with pytest.raises(ValueError, match="draft dtype .* is not supported; use one of float32, bfloat16"):
        load_draft_model(tmp_path, dtype)


@pytest.mark.parametrize("device", ["cuda:7", "mps"])
def test_unavailable_device(tmp_path, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ValueError, match=f"draft device {device} is not"):
        load_draft_model(tmp_path, torch.float32, device)


def test_missing_tensor(tmp_path):
    path = save(make_hf_model("llama"), tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks tensors \['model.layers.1.self_attn.qkv_proj.weight\[k\]'\]"):
        load_draft_model(path, torch.float32)
