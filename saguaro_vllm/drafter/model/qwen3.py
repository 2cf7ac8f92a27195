"""Qwen3 draft model: the Llama layout plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

import torch

from saguaro_vllm.drafter.model.config import DraftModelConfig
from saguaro_vllm.drafter.model.layers import RMSNorm
from saguaro_vllm.drafter.model.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: DraftModelConfig):
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_size, cfg.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
