"""Custom ops of the fused multi-branch draft step: branch attention over the paged KV cache (plus the KV
write), candidate selection, the proposal q'. Each has a plain-torch reference (`reference`), C++ CPU
kernels and CUDA kernels (`csrc/`), loaded once by `loader` (`loader.status()` says what is active)."""

from saguaro_vllm.ops.branch_attention import (
    BranchAttentionMetadata,
    branch_attention,
    write_kv,
)
from saguaro_vllm.ops.candidates import (
    Candidates,
    select_candidates,
    select_candidates_padded,
)
from saguaro_vllm.ops.loader import implementation, status
from saguaro_vllm.ops.proposal import proposal_probs

__all__ = [
    "BranchAttentionMetadata",
    "Candidates",
    "branch_attention",
    "implementation",
    "proposal_probs",
    "select_candidates",
    "select_candidates_padded",
    "status",
    "write_kv",
]
