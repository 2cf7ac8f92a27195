"""Which draft attention shapes (head size, query heads per KV head) each attention implementation runs.

The compiled kernels are specialised; the plain-torch reference (`reference.py`) runs any shape:

- `cpp` (`csrc/attention_cpu.cpp`): head size a multiple of 8 (its vector loops), at most `kMaxRows` (96)
  query heads per KV head (one work item's rows).
- `cuda` (`csrc/cuda/kv_attention.cu`): head size 64 or 128 (a template instance each: one warp of 32 lanes
  holds HEAD / 32 elements per lane), at most `kMaxGroup` (8) query heads per KV head (registers per thread).
- `triton` (`triton_attention.py`, `SAGUARO_ATTENTION=triton`): a power-of-two head size (`tl.arange`).
- `vllm`: vLLM's own kernels, which a CUDA drafter runs for every pass where vLLM has them
  (drafter/vllm_attention.py): its Triton `unified_attention` needs a head size of at least 16 (`tl.dot`);
  FlashAttention, preferred where it applies, takes head sizes that are multiples of 8 up to 256.

Every one needs the query heads to be a multiple of the KV heads (grouped-query attention). Used twice: the
front end refuses a draft the drafter's device cannot run (resolve.py `check_draft_attention`), and
`branch_attention.py` runs the reference for a shape its kernel cannot take (one log line) instead of
failing every step. tests/test_draft_shapes.py checks these numbers against the sources.
"""
from __future__ import annotations

CPP_HEAD_MULTIPLE = 8
CPP_MAX_GROUP = 96
CUDA_HEAD_SIZES = (64, 128)
CUDA_MAX_GROUP = 8
VLLM_MIN_HEAD_SIZE = 16


def unsupported(impl: str, num_heads: int, num_kv_heads: int, head_size: int) -> str | None:
    """Why attention implementation `impl` ("cpp", "cuda", "triton" or "reference") cannot run this shape,
    or None when it can."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return (f"{num_heads} query heads are not a multiple of its {num_kv_heads} key/value heads "
                "(num_attention_heads / num_key_value_heads)")
    group = num_heads // num_kv_heads
    if impl == "cpp":
        if head_size % CPP_HEAD_MULTIPLE:
            return f"head size {head_size} is not a multiple of {CPP_HEAD_MULTIPLE}"
        if group > CPP_MAX_GROUP:
            return f"{group} query heads per key/value head are more than {CPP_MAX_GROUP}"
    elif impl == "cuda":
        if head_size not in CUDA_HEAD_SIZES:
            return f"head size {head_size} is not one of {', '.join(map(str, CUDA_HEAD_SIZES))}"
        if group > CUDA_MAX_GROUP:
            return f"{group} query heads per key/value head are more than {CUDA_MAX_GROUP}"
    elif impl == "triton":
        if head_size < 1 or head_size & (head_size - 1):
            return f"head size {head_size} is not a power of two"
    elif impl == "vllm":
        if head_size < VLLM_MIN_HEAD_SIZE:
            return f"head size {head_size} is less than {VLLM_MIN_HEAD_SIZE}"
    return None


def supported_shapes(impl: str) -> str:
    """The shapes `impl` runs, in words (for error messages)."""
    return {
        "cpp": f"head sizes that are multiples of {CPP_HEAD_MULTIPLE}, at most {CPP_MAX_GROUP} query heads per "
               "key/value head",
        "cuda": f"head sizes {' and '.join(map(str, CUDA_HEAD_SIZES))}, at most {CUDA_MAX_GROUP} query heads per "
                "key/value head",
        "triton": "power-of-two head sizes",
        "vllm": f"head sizes of at least {VLLM_MIN_HEAD_SIZE}",
    }.get(impl, "any head size")
