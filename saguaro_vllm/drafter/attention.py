"""Paged attention over a flattened variable-length batch, with explicit metadata (no global context).

The tokens of several sequences are concatenated; `AttentionMetadata` says where each sequence's queries
start, how long its KV is after this step and which cache blocks hold it. A backend is any function
`attend(q, k, v, kv_cache, meta, scale) -> out` that writes the new K/V into the cache and attends. The
metadata names its backend, so one model can run steps with different attention patterns: the chain
attention here, and later the multi-branch step (a subclass of the metadata with depth/step per query and
its own fused op) without the model knowing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class AttentionBackend(Protocol):
    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot (the job of vLLM's `reshape_and_cache_flash`)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


#: Multi-token forwards attend at most this many queries of a sequence at a time, and fewer where the score
#: block `[num_heads, queries, visible keys]` would exceed `REFERENCE_SCORE_BUDGET` elements (32 MB in fp32), so
#: a long prompt never builds a mask or score matrix over its whole context.
REFERENCE_QUERY_CHUNK = 256
REFERENCE_SCORE_BUDGET = 1 << 23


def reference_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    query_chunk: int | None = None,
) -> torch.Tensor:
    """Plain-torch causal paged attention, fp32 accumulation; the reference fused ops are tested against.

    Query `i` of a sequence with `n` queries and KV length `L` sits at KV index `L - n + i` and sees KV
    indices `0..L-n+i` of its own sequence. A sequence's queries are processed in chunks (`query_chunk`,
    default `REFERENCE_QUERY_CHUNK`, fewer for many heads and long contexts): each chunk attends only to the
    keys its last query sees, with a mask over the chunk alone; keys no query of the chunk sees are left out
    rather than masked (they would contribute exp(-inf) = 0).
    """
    write_kv(k, v, kv_cache, meta.slot_mapping)
    block_size = kv_cache.shape[2]
    out = torch.empty_like(q)
    starts = meta.query_start_loc_cpu
    chunk = query_chunk or REFERENCE_QUERY_CHUNK
    for s, kv_len in enumerate(meta.seq_lens_cpu):
        q_start, q_end = starts[s], starts[s + 1]
        n = q_end - q_start
        blocks = meta.block_table[s, : -(-kv_len // block_size)]
        # [2, blocks, block_size, Hkv, D] -> [2, Hkv, kv_len, D]
        kv = kv_cache[:, blocks].flatten(1, 2)[:, :kv_len].transpose(1, 2).float()
        rows = max(1, min(chunk, REFERENCE_SCORE_BUDGET // (q.shape[1] * kv_len)))
        for c0 in range(0, n, rows):
            c1 = min(n, c0 + rows)
            m, visible = c1 - c0, kv_len - n + c1  # the chunk's last query sees keys 0..visible-1
            qs = q[q_start + c0 : q_start + c1].transpose(0, 1).float()
            mask = None
            if m > 1:
                mask = torch.ones(m, visible, dtype=torch.bool, device=q.device).tril(visible - m)
            o = F.scaled_dot_product_attention(qs, kv[0, :, :visible], kv[1, :, :visible], attn_mask=mask,
                                               scale=scale, enable_gqa=True)
            out[q_start + c0 : q_start + c1] = o.transpose(0, 1).to(q.dtype)
    return out


@dataclass
class AttentionMetadata:
    """Everything a backend needs for one forward pass over a flattened batch of sequences.

    Device tensors are what kernels read; the `_cpu` lists spare the reference loop device syncs.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query counts
    seq_lens: torch.Tensor  # [num_seqs] int32: KV length of each sequence after this step
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32: block ids, padded with 0
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    backend: AttentionBackend = reference_paged_attention

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class Attention(nn.Module):
    """Head bookkeeping around the metadata's backend (vLLM's `Attention` layer, minus the context)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads * head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads * head_size]
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        t = q.shape[0]
        out = meta.backend(
            q.view(t, self.num_heads, self.head_size),
            k.view(t, self.num_kv_heads, self.head_size),
            v.view(t, self.num_kv_heads, self.head_size),
            kv_cache,
            meta,
            self.scale,
        )
        return out.view(t, self.num_heads * self.head_size)
