"""vLLM's own paged variable-length attention as drafter attention backends (CUDA only).

On a CUDA device every drafter forward (one-token decode passes and multi-token chunks alike) runs one of
vLLM's kernels that read the paged cache through block tables, in the drafter's own cache layout (vLLM's
flash layout `[2, num_blocks, block_size, num_kv_heads, head_size]`, so `kv_cache[0]` / `kv_cache[1]` are
exactly the key / value caches those kernels take; no copy, no layout change):

- FlashAttention through `vllm.vllm_flash_attn.flash_attn_varlen_func` (the version vLLM itself picks for
  this GPU: FA3 on Hopper, FA2 elsewhere) when the GPU build has it, the cache is fp16/bf16, the block size
  a multiple of 16 and the head size a multiple of 8 up to 256;
- otherwise vLLM's pure-Triton `unified_attention` (`vllm/v1/attention/ops/triton_unified_attention.py`): any
  of fp32/fp16/bf16, GQA, its 3D split-softmax kernel for decode passes of few sequences and its 2D kernel
  for everything else.

The metadata maps one to one: `cu_seqlens_q` = `query_start_loc`, `seqused_k` = `seq_lens`, `block_table`,
`max_seqlen_q` / `max_seqlen_k` = `max_query_len` / `max_seq_len`; causal, bottom-right aligned (query `i` of
`n` sees KV `0..L-n+i`, as in `reference_paged_attention`). New K/V are written first, with vLLM's
`reshape_and_cache_flash` when its CUDA op is loaded, else with `attention.write_kv`.

Everything of vLLM is imported lazily, at the first `select` on a CUDA device: the drafter imports and runs
where vLLM (or its GPU build) is absent, and then keeps its own kernels (`decode_attention` for one-token
passes, `reference_paged_attention` for the rest), exactly as on CPU. `SAGUARO_DRAFT_ATTENTION` overrides the
choice: `auto` (default), `triton` (vLLM's Triton kernel even where FlashAttention exists) or `saguaro`
(never vLLM's kernels). `attention_implementation()` names what is active.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from saguaro_vllm.drafter.attention import AttentionBackend, AttentionMetadata, write_kv

logger = logging.getLogger(__name__)

ENV = "SAGUARO_DRAFT_ATTENTION"
MODES = ("auto", "triton", "saguaro")
TRITON_UNIFIED = "vllm-triton-unified"
#: vLLM's Triton kernel reads whole KV tiles (at most 128 positions) of the block table without a mask, so the
#: table handed to it covers `max_seq_len` rounded up to this many positions (padding block ids are 0; the
#: keys they point at are masked out).
_TILE_COVER = 128
# unified_attention's 3D (split-softmax) decode kernel: vLLM's own settings (backends/triton_attn.py).
_MIN_LAUNCH_GRID_SIZE_2D = 128
_NUM_PAR_SOFTMAX_SEGMENTS = 16


# ---- lazy imports of vLLM -----------------------------------------------------------------------------
#: kernel -> why vLLM's kernel is unavailable in this process (filled by the lazy imports below).
_unavailable: dict[str, str] = {}


def unavailable_reason() -> str | None:
    """Why `select` kept the drafter's own kernels on CUDA (e.g. "vllm_flash_attn: No module named 'vllm'"),
    after a `select` on a CUDA device; None when nothing of vLLM was found missing."""
    return "; ".join(f"{k}: {v}" for k, v in _unavailable.items()) or None


@functools.cache
def _flash_attn():
    """`(flash_attn_varlen_func, is_fa_version_supported)`, or None without vLLM's FlashAttention build."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported
    except Exception as exc:  # ImportError, or no CUDA extensions in this build (the CPU build raises)
        logger.debug("vllm_flash_attn unavailable: %s", exc)
        _unavailable["vllm_flash_attn"] = str(exc)
        return None
    return flash_attn_varlen_func, is_fa_version_supported


@functools.cache
def _unified_attention():
    """vLLM's `unified_attention`, or None where vLLM is absent or runs without Triton (its placeholder)."""
    try:
        import vllm.triton_utils as triton_utils

        if not triton_utils.HAS_TRITON:
            _unavailable["unified_attention"] = "vLLM has no Triton here"
            return None
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception as exc:
        logger.debug("vLLM's unified_attention unavailable: %s", exc)
        _unavailable["unified_attention"] = str(exc)
        return None
    return unified_attention


@functools.cache
def _reshape_and_cache_flash():
    """vLLM's `reshape_and_cache_flash` (the KV write of its flash layout) where its CUDA op is loaded."""
    try:
        from vllm import _custom_ops

        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018 - raises if the op is not registered
    except Exception:
        return None
    return _custom_ops.reshape_and_cache_flash


def _fa_version(head_size: int, block_size: int) -> int | None:
    fa = _flash_attn()
    if fa is None:
        return None
    _, supported = fa
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        version = get_flash_attn_version(head_size=head_size, kv_cache_block_size=block_size)
    except Exception as exc:
        logger.debug("get_flash_attn_version failed (%s); trying FA2", exc)
        version = None
    for v in (version, 2):
        try:
            if v is not None and supported(v):
                return v
        except Exception:
            pass
    return None


# ---- the KV write -------------------------------------------------------------------------------------
_unit_scales: dict[torch.device, torch.Tensor] = {}


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V at its slot: vLLM's `reshape_and_cache_flash` on CUDA where it is loaded,
    else `attention.write_kv`."""
    op = _reshape_and_cache_flash() if kv_cache.is_cuda else None
    if op is None:
        write_kv(k, v, kv_cache, slot_mapping)
        return
    scale = _unit_scales.get(kv_cache.device)
    if scale is None:
        scale = _unit_scales[kv_cache.device] = torch.ones((), dtype=torch.float32, device=kv_cache.device)
    op(k.to(kv_cache.dtype), v.to(kv_cache.dtype), kv_cache[0], kv_cache[1], slot_mapping, "auto", scale, scale)


def _tiled_block_table(meta: AttentionMetadata, block_size: int) -> torch.Tensor:
    """The block table widened so that whole-tile reads stay inside it (computed once per forward, shared by
    the layers)."""
    table = getattr(meta, "_vllm_tiled_block_table", None)
    if table is None:
        table = meta.block_table
        cover = -(-meta.max_seq_len // _TILE_COVER) * _TILE_COVER
        width = max(table.shape[1], -(-cover // block_size))
        if width != table.shape[1] or table.stride(1) != 1:
            padded = table.new_zeros(table.shape[0], width)
            padded[:, : table.shape[1]] = table
            table = padded
        meta._vllm_tiled_block_table = table
    return table


# ---- the backends -------------------------------------------------------------------------------------
class FlashAttention:
    """An `AttentionBackend`: write the new K/V, then vLLM's FlashAttention over the paged cache."""

    def __init__(self, fa_version: int):
        self.fa_version = fa_version
        self.name = f"vllm-flash-attn-{fa_version}"

    def __call__(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        flash_attn_varlen_func, _ = _flash_attn()
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        query = q.to(kv_cache.dtype)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        flash_attn_varlen_func(
            q=query, k=kv_cache[0], v=kv_cache[1], max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_k=meta.max_seq_len, seqused_k=meta.seq_lens,
            softmax_scale=scale, causal=True, block_table=meta.block_table, out=out, fa_version=self.fa_version,
            num_splits=getattr(meta, "num_splits", 0),  # fixed under CUDA graphs (static_forward.py)
        )
        return out.to(q.dtype)


class UnifiedTritonAttention:
    """An `AttentionBackend`: write the new K/V, then vLLM's Triton `unified_attention` over the paged cache.

    Decode passes of at most `128 // num_kv_heads` sequences take its 3D kernel (the context split into 16
    segments, merged by `reduce_segments`), as in vLLM's Triton backend; the scratch for it is allocated once.
    """

    name = TRITON_UNIFIED

    def __init__(self):
        self._scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _segments(self, rows: int, heads: int, head_size: int, device: torch.device):
        padded = 1 << max(0, head_size - 1).bit_length()
        s = self._scratch
        if s is None or s[0].shape != (rows, heads, _NUM_PAR_SOFTMAX_SEGMENTS, padded) or s[0].device != device:
            shape = (rows, heads, _NUM_PAR_SOFTMAX_SEGMENTS)
            s = self._scratch = (
                torch.empty(*shape, padded, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
                torch.empty(shape, dtype=torch.float32, device=device),
            )
        return s

    def __call__(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        unified_attention = _unified_attention()
        if unified_attention is None:
            raise RuntimeError("vLLM's triton unified_attention is not available")
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        query = q.to(kv_cache.dtype)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        threshold = max(1, _MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads)
        segm_output = segm_max = segm_expsum = None
        if meta.max_query_len == 1 and meta.num_seqs <= threshold:
            segm_output, segm_max, segm_expsum = self._segments(threshold, query.shape[1], head_size, query.device)
        unified_attention(
            q=query, k=kv_cache[0], v=kv_cache[1], out=out, cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len, seqused_k=meta.seq_lens, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=True, window_size=(-1, -1),
            block_table=_tiled_block_table(meta, block_size), softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None,
            seq_threshold_3D=threshold, num_par_softmax_segments=_NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=segm_output, softmax_segm_max=segm_max, softmax_segm_expsum=segm_expsum,
        )
        return out.to(q.dtype)


# ---- the choice ---------------------------------------------------------------------------------------
def _own_kernels(device: torch.device) -> str:
    """The drafter's own attention on `device`: the compiled branch-attention op for one-token passes (when
    built) and the chunked `reference_paged_attention` for multi-token passes."""
    from saguaro_vllm.ops import loader

    if not loader.use_compiled(device):
        return "reference"
    return f"{loader.active(device)['attention']}-decode+reference"


def select(device: torch.device | str, dtype: torch.dtype, head_size: int, block_size: int
           ) -> tuple[str, AttentionBackend | None]:
    """The drafter's attention for a model on `device`: `(name, backend)`, where `backend` runs every forward,
    or None to keep the drafter's own kernels (all non-CUDA devices, or vLLM's kernels unavailable)."""
    device = torch.device(device)
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if device.type != "cuda" or mode == "saguaro":
        return _own_kernels(device), None
    if (mode == "auto" and dtype in (torch.float16, torch.bfloat16) and block_size % 16 == 0
            and head_size % 8 == 0 and head_size <= 256):
        version = _fa_version(head_size, block_size)
        if version is not None:
            backend = FlashAttention(version)
            return backend.name, backend
    # tl.dot needs at least 16 along the head dimension.
    if head_size >= 16 and _unified_attention() is not None:
        backend = UnifiedTritonAttention()
        return backend.name, backend
    return _own_kernels(device), None


def attention_implementation(device: torch.device | str, dtype: torch.dtype, head_size: int, block_size: int
                             ) -> str:
    """Which attention the drafter runs for a model on `device`, e.g. "vllm-flash-attn-3",
    "vllm-triton-unified" (every forward), "cpp-decode+reference" (the drafter's own kernels: the compiled
    branch-attention op for one-token passes, the chunked reference for the rest) or "reference"."""
    return select(device, dtype, head_size, block_size)[0]
