"""Attention of the fused multi-branch draft step over the paged KV cache (design: ssd-algorithm.md §4).

One query per branch. A query of request r at depth j and step s attends to
  (a) the committed prefix of r: logical positions 0 .. N_r - 1 (through r's block table),
  (b) the glue tokens b, x_1..x_j: logical positions N_r .. N_r + j,
  (c) its own branch tokens of steps 0..s, at physical slots `branch_slots[q, 0..s]`,
and nothing of other branches. The pattern comes from (owner, depth, step) per query: no dense mask.
Step -1 means no branch tokens: the query of glue token j (the glue forward itself) is (depth j, step -1).

Example: N_r = 3, K = 2, a depth-1 branch at step 1 sees prefix slots of positions 0,1,2, glue positions
3,4 (b, x_1) and its own slots branch_slots[q, 0], branch_slots[q, 1]: 7 keys.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from saguaro_vllm.ops import attention_limits, loader, reference


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value `[T, Hkv, D]` at `slot_mapping` `[T]` (negative slots skipped), in place."""
    if loader.use_compiled(kv_cache.device):
        torch.ops.saguaro.write_kv(key, value, kv_cache, slot_mapping)
    else:
        reference.write_kv(key, value, kv_cache, slot_mapping)


def branch_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    owners: torch.Tensor,
    depths: torch.Tensor,
    steps: torch.Tensor,
    branch_slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`query` [Q, H, D] (head dim contiguous; other strides free) -> [Q, H, D] in the query's dtype.

    `kv_cache` [2, num_blocks, block_size, Hkv, D]; `block_tables` [B, max_blocks] int32 covering at least
    N_r + max depth + 1 positions; `prefix_lens` [B]; `owners`, `depths`, `steps` [Q]; `branch_slots`
    [Q, S] (S <= 62) int; depth + step <= 62. The kernels accumulate in fp32; the query is cast to the cache dtype.
    """
    q = query.to(kv_cache.dtype)
    if query.device.type == "cuda" and os.environ.get("SAGUARO_ATTENTION") == "triton" and _runs("triton", q, kv_cache):
        from saguaro_vllm.ops import triton_attention

        return triton_attention.branch_attention(
            q, kv_cache, block_tables, prefix_lens, owners, depths, steps, branch_slots, scale
        ).to(query.dtype)
    if loader.use_compiled(query.device) and _runs(loader.implementation(query.device), q, kv_cache):
        out = torch.ops.saguaro.branch_attention(
            q, kv_cache, block_tables, prefix_lens, owners, depths, steps, branch_slots, float(scale)
        )
    else:
        out = reference.branch_attention(
            q, kv_cache, block_tables, prefix_lens, owners, depths, steps, branch_slots, scale
        )
    return out.to(query.dtype)


_fallbacks: set[tuple] = set()  # (implementation, heads, kv heads, head size) already logged


def _runs(impl: str, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether kernel `impl` takes this shape (attention_limits.py); if not, the reference runs it, said once."""
    shape = (impl, q.shape[1], kv_cache.shape[3], q.shape[2])
    why = attention_limits.unsupported(*shape)
    if why is not None and shape not in _fallbacks:
        _fallbacks.add(shape)
        logging.getLogger("saguaro_vllm.ops").warning(
            "saguaro ops: the %s attention kernel cannot run this draft (%s; it runs %s): its attention runs the "
            "plain-torch reference instead (slower)", impl, why, attention_limits.supported_shapes(impl))
    return why is None


@dataclass
class BranchAttentionMetadata:
    """Metadata of one multi-branch step; usable as the drafter's attention metadata (it names its backend).

    `slot_mapping` is where each query's new K/V goes: `branch_slots[q, steps[q]]`.
    """

    slot_mapping: torch.Tensor  # [Q] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    prefix_lens: torch.Tensor  # [B] int32
    owners: torch.Tensor  # [Q] int32
    depths: torch.Tensor  # [Q] int32
    steps: torch.Tensor  # [Q] int32
    branch_slots: torch.Tensor  # [Q, S] int64

    @classmethod
    def build(cls, block_tables, prefix_lens, owners, depths, steps, branch_slots) -> BranchAttentionMetadata:
        slots = branch_slots.long().gather(1, steps.long().clamp(min=0)[:, None]).squeeze(1)
        return cls(slots, block_tables, prefix_lens, owners, depths, steps, branch_slots)

    @staticmethod
    def backend(q, k, v, kv_cache, meta: BranchAttentionMetadata, scale: float) -> torch.Tensor:
        """The `AttentionBackend` of drafter/attention.py: write the new K/V, then attend."""
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return branch_attention(q, kv_cache, meta.block_tables, meta.prefix_lens, meta.owners, meta.depths,
                                meta.steps, meta.branch_slots, scale)


def decode_attention(q, k, v, kv_cache, meta, scale: float) -> torch.Tensor:
    """An `AttentionBackend` (drafter/attention.py) for passes where every sequence has exactly one new
    token (decode steps, the branches of a pre-draft, the glue of one token): the branch-attention op with
    one query per sequence at depth 0, step -1, i.e. a query that sees its sequence's prefix (all but the
    new token, through its block table) and the "glue" position right after it (the new token itself).
    Same result as `reference_paged_attention`, without a per-sequence Python loop.
    """
    write_kv(k, v, kv_cache, meta.slot_mapping)
    n = q.shape[0]
    zeros = torch.zeros(n, dtype=torch.int32, device=q.device)
    return branch_attention(
        q, kv_cache, meta.block_table, meta.seq_lens - 1, torch.arange(n, dtype=torch.int32, device=q.device),
        zeros, zeros - 1, torch.zeros(n, 1, dtype=torch.int64, device=q.device), scale,
    )
