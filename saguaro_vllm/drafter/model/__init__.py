"""Draft model families loaded from Hugging Face checkpoints."""

from saguaro_vllm.drafter.model.config import SUPPORTED_ARCHITECTURES, DraftModelConfig
from saguaro_vllm.drafter.model.llama import LlamaForCausalLM
from saguaro_vllm.drafter.model.loader import load_draft_model, read_model_info, resolve_device, resolve_dtype
from saguaro_vllm.drafter.model.qwen3 import Qwen3ForCausalLM

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DraftModelConfig",
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "load_draft_model",
    "read_model_info",
    "resolve_device",
    "resolve_dtype",
]
