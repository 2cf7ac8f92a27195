"""What the drafter needs from a Hugging Face `config.json`, validated once with errors that say the fix.

Accepts both config spellings in the wild: `rope_theta` + `rope_scaling` (transformers < 5) and
`rope_parameters` (transformers >= 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_ARCH_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class DraftModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, float] | None  # llama3 parameters; None for plain RoPE
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    checkpoint_dtype: str | None  # as saved, e.g. "bfloat16"
    bos_token_id: int | None
    eos_token_id: int | list[int] | None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], path: str) -> DraftModelConfig:
        arch = _architecture(hf, path)
        num_heads = hf["num_attention_heads"]
        head_size = hf.get("head_dim") or hf["hidden_size"] // num_heads
        theta, scaling = _rope(hf, path)
        _reject_unsupported(hf, path)
        return cls(
            path=path,
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_size=head_size,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 0),
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )


def _architecture(hf: dict[str, Any], path: str) -> str:
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""), "")
    if arch not in SUPPORTED_ARCHITECTURES:
        found = arch or f"model_type {hf.get('model_type')!r}"
        raise ValueError(
            f"draft model {path}: architecture {found} is not supported by the drafter; "
            f"use a draft of one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(hf: dict[str, Any], path: str) -> tuple[float, dict[str, float] | None]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"draft model {path}: partial rotary embeddings are not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(
            f"draft model {path}: rope type {rope_type!r} is not supported; "
            "the drafter supports plain RoPE and llama3 scaling"
        )
    return float(theta), {
        "factor": float(scaling["factor"]),
        "low_freq_factor": float(scaling["low_freq_factor"]),
        "high_freq_factor": float(scaling["high_freq_factor"]),
        "original_max_position_embeddings": float(
            scaling.get("original_max_position_embeddings") or hf["max_position_embeddings"]
        ),
    }


def _reject_unsupported(hf: dict[str, Any], path: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"draft model {path}: hidden_act {act!r} is not supported (only 'silu')")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ValueError(f"draft model {path}: sliding-window attention is not supported by the drafter")
