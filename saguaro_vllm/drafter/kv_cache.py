"""The drafter's paged KV cache, in vLLM's layout and with vLLM's slot semantics.

Each layer owns one tensor `[2, num_blocks, block_size, num_kv_heads, head_size]` (vLLM's flash-attention
layout: index 0 holds keys, 1 values), so vLLM's cache kernels (`reshape_and_cache_flash`, flash/paged
attention) can serve it unchanged where vLLM is installed. A token's KV lives at
`slot = block_id * block_size + offset`; a request's block table lists its blocks in logical order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class OutOfBlocksError(RuntimeError):
    """Not enough free KV blocks. Callers catch it: the affected requests get no drafts until space frees."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"draft KV cache is full: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


@dataclass(frozen=True)
class KVCacheConfig:
    """Size of the drafter's KV cache. `dtype=None` means the model's dtype."""

    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"KVCacheConfig.num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"KVCacheConfig.block_size must be >= 1, got {self.block_size}")


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_size * itemsize


def num_blocks_for_budget(
    budget_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> int:
    """How many blocks fit in `budget_bytes`; raises ValueError when not even one does."""
    per_block = kv_bytes_per_block(num_layers, block_size, num_kv_heads, head_size, dtype)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget_bytes} bytes holds no block of {per_block} bytes; "
            "raise the drafter's KV cache memory or lower block_size"
        )
    return int(num_blocks)


class BlockAllocator:
    """Free list of block ids. All-or-nothing allocation; double frees are bugs and raise."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Pop from the end: low ids first, so a fresh cache fills from the start.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use = bytearray(num_blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        blocks = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for b in blocks:
            self._in_use[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._in_use[b]:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._in_use[b] = 0
        self._free.extend(reversed(blocks))


class BlockTable:
    """One request's blocks in logical order; grows and shrinks through a shared allocator."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        self._allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold."""
        return len(self.blocks) * self.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks required to hold `num_tokens` tokens in total."""
        return max(0, -(-num_tokens // self.block_size) - len(self.blocks))

    def ensure(self, num_tokens: int) -> None:
        """Grow to hold `num_tokens` tokens; raises OutOfBlocksError and changes nothing if it can't."""
        need = self.blocks_needed(num_tokens)
        if need:
            self.blocks.extend(self._allocator.allocate(need))

    def shrink(self, num_tokens: int) -> None:
        """Return the blocks not needed for the first `num_tokens` tokens."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(self.blocks):
            self._allocator.free(self.blocks[keep:])
            del self.blocks[keep:]

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of logical token positions `start..end-1` (must be within capacity)."""
        bs, blocks = self.block_size, self.blocks
        return [blocks[i // bs] * bs + i % bs for i in range(start, end)]


class PagedKVCache:
    """The per-layer cache tensors plus the allocator that hands out their blocks."""

    def __init__(
        self,
        cfg: KVCacheConfig,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.dtype = cfg.dtype or dtype
        shape = (2, cfg.num_blocks, cfg.block_size, num_kv_heads, head_size)
        # Zeroed so that reading a never-written slot (a bug) gives finite numbers, not NaNs from garbage.
        self.layers: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(cfg.num_blocks)

    def new_block_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.block_size)
