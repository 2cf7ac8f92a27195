"""Llama-family draft model (Llama-2/3, GQA, llama3 RoPE scaling, tied or untied embeddings).

Module names mirror the Hugging Face checkpoint, except that q/k/v and gate/up are fused
(`stacked_params` says how checkpoint tensors map onto the fused weights).
"""

from __future__ import annotations

import torch
from torch import nn

from saguaro_vllm.drafter.attention import Attention, AttentionMetadata
from saguaro_vllm.drafter.model.config import DraftModelConfig
from saguaro_vllm.drafter.model.layers import Linear, MergedLinear, RMSNorm, RotaryEmbedding, SiluMLP, apply_rope


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        q_size, kv_size = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                     cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.head_size**-0.5)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head normalisation before RoPE: none for Llama (Qwen3 overrides)."""
        return q, k

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x)
        q, k = self.norm_qk(q.view(t, self.num_heads, self.head_size),
                            k.view(t, self.num_kv_heads, self.head_size))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.o_proj(self.attn(q.view(t, -1), k.view(t, -1), v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftModelConfig, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SiluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: DraftModelConfig, attention_cls: type[LlamaAttention]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, attention_cls) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention
    # checkpoint projection name -> (fused module name, shard)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: DraftModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.attention_cls)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after materialising)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]: RoPE positions, independent of cache slots
        kv_caches: list[torch.Tensor],  # one per layer, see kv_cache.PagedKVCache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # final hidden states [num_tokens, hidden_size]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given rows only (callers select the rows they sample from)."""
        return self.lm_head(hidden).float()
