"""The drafter's paged KV cache, in vLLM's layout and with vLLM's slot semantics.

Each layer owns one tensor `[2, num_blocks, block_size, num_kv_heads, head_size]` (vLLM's flash-attention
layout: index 0 holds keys, 1 values), so vLLM's cache kernels (`reshape_and_cache_flash`, flash/paged
attention) can serve it unchanged where vLLM is installed. A token's KV lives at
`slot = block_id * block_size + offset`; a request's block table lists its blocks in logical order.
Blocks are reference-counted so that forked sequences (the branches of SSD's pre-drafting) share their
common prefix instead of copying it; shared blocks are read-only (copy-on-write).
"""

from __future__ import annotations

import collections
import contextlib
import itertools

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
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


#: `saguaro.kv_cache_gb: "auto"` (docs/configuration.md): the fixed budget on CPU and on a GPU the drafter
#: shares with the target (the front end resolves those to this number), and the least a GPU of its own gets
#: while `AUTO_KV_HEADROOM` stays free; there it takes `AUTO_KV_FRACTION` of the free memory measured after
#: loading the draft (the rest is for activations, the pre-drafting workspace and other processes).
AUTO_KV_GIB = 1.0
AUTO_KV_FRACTION = 0.5
AUTO_KV_HEADROOM = 2**29


def kv_budget_bytes(kv_cache_gb: float | str, device: torch.device | str,
                    free_bytes: Callable[[], int] | None = None) -> int:
    """Bytes for the drafter's KV cache: `kv_cache_gb` GiB, or for "auto" `AUTO_KV_GIB` off CUDA and on CUDA
    max(AUTO_KV_FRACTION x free, min(AUTO_KV_GIB, free - AUTO_KV_HEADROOM)), `free` being the device's free
    memory now (`free_bytes`, default `torch.cuda.mem_get_info(device)[0]`: call it after loading the draft)."""
    if kv_cache_gb != "auto":
        return int(float(kv_cache_gb) * 2**30)
    if torch.device(device).type != "cuda":
        return int(AUTO_KV_GIB * 2**30)
    free = int(free_bytes() if free_bytes is not None else torch.cuda.mem_get_info(torch.device(device))[0])
    return max(0, int(max(AUTO_KV_FRACTION * free, min(AUTO_KV_GIB * 2**30, free - AUTO_KV_HEADROOM))))


class BlockAllocator:
    """Reference-counted free list of block ids. All-or-nothing allocation; over-freeing is a bug and raises.

    Forked sequences share blocks: each holder counts once, and a block returns to the free list when its
    last holder lets go.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Pop from the end: low ids first, so a fresh cache fills from the start.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        blocks = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (all must be allocated)."""
        for b in blocks:
            if not self._refs[b]:
                raise ValueError(f"block {b} shared while free")
        for b in blocks:
            self._refs[b] += 1

    def free_many(self, tables: list[list[int]]) -> None:
        """`free(blocks)` for each list in order (the same free list, block for block); all checked before
        anything changes."""
        refs = self._refs
        drops = collections.Counter(itertools.chain.from_iterable(tables))
        for b, n in drops.items():
            if n > refs[b]:
                raise ValueError(f"block {b} freed twice or never allocated")
        free = self._free
        for blocks in tables:
            for b in reversed(blocks):
                refs[b] -= 1
                if not refs[b]:
                    free.append(b)

    def free_rows(self, table: np.ndarray, lengths: np.ndarray) -> None:
        """`free` of each row's first `lengths[i]` blocks, row after row (the same free list, block for block),
        without Python per block held: a block returns to the free list at its last holder, so in the order of
        its last occurrence among the rows' blocks as `free` visits them (each row reversed). All checked
        before anything changes."""
        cols = lengths[:, None] - 1 - np.arange(table.shape[1])[None, :]
        visited = np.take_along_axis(table, np.maximum(cols, 0), axis=1)[cols >= 0]
        if not len(visited):
            return
        blocks, first_reversed, drops = np.unique(visited[::-1], return_index=True, return_counts=True)
        ids = blocks.tolist()
        refs = self._refs
        left = np.fromiter(map(refs.__getitem__, ids), dtype=np.int64, count=len(ids)) - drops
        if (left < 0).any():
            raise ValueError(f"block {blocks[np.argmax(left < 0)]} freed twice or never allocated")
        list(map(refs.__setitem__, ids, left.tolist()))
        gone = left == 0
        last = len(visited) - 1 - first_reversed[gone]
        self._free.extend(blocks[gone][np.argsort(last)].tolist())

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; checked in full before anything changes."""
        refs = self._refs
        if len(set(blocks)) == len(blocks):  # (a table's blocks, each once: the check is one pass)
            if not all(refs[b] > 0 for b in blocks):
                b = next(b for b in blocks if refs[b] <= 0)
                raise ValueError(f"block {b} freed twice or never allocated")
        else:
            drops: dict[int, int] = {}
            for b in blocks:
                drops[b] = drops.get(b, 0) + 1
                if drops[b] > refs[b]:
                    raise ValueError(f"block {b} freed twice or never allocated")
        free = self._free
        for b in reversed(blocks):
            refs[b] -= 1
            if not refs[b]:
                free.append(b)


@dataclass(frozen=True)
class ForkRows:
    """Forks as rows (`PagedKVCache.fork_rows`): which of those asked for fit, and per admitted fork its block
    table row (int32, padded with 0; the parent's full blocks, shared, then its own), blocks, and the blocks it
    copied (its partial block) and reserved for growth."""

    admitted: np.ndarray
    table: np.ndarray
    num_blocks: np.ndarray
    copied: np.ndarray
    grown: np.ndarray


class BlockTable:
    """One sequence's blocks in logical order; grows, shrinks and forks through a shared allocator.

    Blocks may be shared with forked sequences. A shared block is never written: `ensure(..., write_from)`
    first swaps each shared block in the write range for a private copy (`copy_block(src, dst)` copies a
    block's contents in every layer).
    """

    def __init__(
        self, allocator: BlockAllocator, block_size: int, copy_block: Callable[[int, int], None] | None = None
    ):
        self._allocator = allocator
        self._copy_block = copy_block
        self.block_size = block_size
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        """Tokens the allocated blocks can hold."""
        return len(self.blocks) * self.block_size

    def _shared_in(self, write_from: int, num_tokens: int) -> list[int]:
        """Indices of shared blocks holding any of the token positions `write_from..num_tokens-1`."""
        if num_tokens <= write_from:
            return []
        end = min(len(self.blocks), -(-num_tokens // self.block_size))
        first = write_from // self.block_size
        return [i for i in range(first, end) if self._allocator.refcount(self.blocks[i]) > 1]

    def blocks_needed(self, num_tokens: int, write_from: int | None = None) -> int:
        """Blocks to allocate to hold `num_tokens` tokens in total, plus (when `write_from` is given) the
        private copies of shared blocks that writing positions `write_from..num_tokens-1` needs."""
        grow = max(0, -(-num_tokens // self.block_size) - len(self.blocks))
        return grow + (len(self._shared_in(write_from, num_tokens)) if write_from is not None else 0)

    def ensure(self, num_tokens: int, write_from: int | None = None) -> None:
        """Grow to hold `num_tokens` tokens and make positions `write_from..num_tokens-1` writable;
        raises OutOfBlocksError and changes nothing if it can't."""
        shared = self._shared_in(write_from, num_tokens) if write_from is not None else []
        if shared and self._copy_block is None:
            raise RuntimeError("writing a shared block needs a block table made by PagedKVCache")
        grow = max(0, -(-num_tokens // self.block_size) - len(self.blocks))
        new = self._allocator.allocate(grow + len(shared))
        for i, dst in zip(shared, new[grow:], strict=True):
            self._copy_block(self.blocks[i], dst)
            self._allocator.free([self.blocks[i]])
            self.blocks[i] = dst
        self.blocks.extend(new[:grow])

    def shrink(self, num_tokens: int) -> None:
        """Let go of the blocks not needed for the first `num_tokens` tokens."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(self.blocks):
            self._allocator.free(self.blocks[keep:])
            del self.blocks[keep:]

    def fork(self, num_tokens: int) -> BlockTable:
        """A new table for the first `num_tokens` tokens: full blocks shared, the partial last block copied
        into a fresh one (so neither side ever writes into a shared block while appending). Raises
        OutOfBlocksError, changing nothing, when the copy has no block."""
        if not 0 <= num_tokens <= self.capacity:
            raise ValueError(f"cannot fork {num_tokens} tokens from a table holding {self.capacity}")
        full, partial = divmod(num_tokens, self.block_size)
        child = BlockTable(self._allocator, self.block_size, self._copy_block)
        if partial:
            if self._copy_block is None:
                raise RuntimeError("forking a partial block needs a block table made by PagedKVCache")
            (copy,) = self._allocator.allocate(1)
            self._copy_block(self.blocks[full], copy)
        self._allocator.share(self.blocks[:full])
        child.blocks = self.blocks[:full] + ([copy] if partial else [])
        return child

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
        # Zeroed so that reading a never-written slot (a bug) gives finite numbers, not NaNs from garbage;
        # written, not calloc'ed (torch.zeros of a large CPU tensor maps pages lazily): the whole budget is
        # resident from the start, so an oversized `kv_cache_gb` shows at start-up and the drafter's memory
        # does not creep up as requests reach blocks no earlier request touched.
        self.layers: list[torch.Tensor] = [
            torch.empty(shape, dtype=self.dtype, device=device).zero_() for _ in range(num_layers)
        ]
        self.allocator = BlockAllocator(cfg.num_blocks)
        self._deferred: dict[int, int] | None = None  # dst -> src while `deferred_copies` is open

    def new_block_table(self) -> BlockTable:
        return BlockTable(self.allocator, self.block_size, self.copy_block)

    def fork_tables(self, tables: list[BlockTable], num_tokens: list[int], new_tokens: list[int]
                    ) -> list[tuple[BlockTable | None, int, int]]:
        """For each (table, n, m) in order: `table.fork(n)`, then `ensure(n + m, write_from=n)` on the child,
        where the free blocks hold both (the partial block's copy and the growth past it); else nothing (a
        fork whose growth does not fit gives its copy back: the free list is as before). The same blocks,
        block for block, as those calls one by one; but a fork's only Python is its own new blocks: the
        shared prefix's reference counts are raised once per table and fork length, and the partial blocks are
        copied together (`copy_blocks`). Returns per fork (child table or None, blocks copied, blocks
        grown). `n` must be within the table's capacity (ValueError before anything changes)."""
        bs, alloc, copy_block = self.block_size, self.allocator, self.copy_block
        longest: dict[int, tuple[BlockTable, int]] = {}  # per table (by id): the longest fork
        for table, n in zip(tables, num_tokens, strict=True):
            if n < 0:
                raise ValueError(f"cannot fork {n} tokens")
            if n > longest.get(id(table), (table, 0))[1]:
                longest[id(table)] = (table, n)
        for table, n in longest.values():
            if n > table.capacity:
                raise ValueError(f"cannot fork {n} tokens from a table holding {table.capacity}")
        free, refs = alloc._free, alloc._refs
        num_free = len(free)
        first: dict[int, int] = {}  # id(table) -> the index of its first fork
        shared: list[tuple[int, int]] = []  # (that index, full blocks) per fork
        copies: list[tuple[int, int]] = []
        out: list[tuple[BlockTable | None, int, int]] = []
        for i, (table, n, m) in enumerate(zip(tables, num_tokens, new_tokens, strict=True)):
            full, partial = divmod(n, bs)
            copied = 1 if partial else 0
            need = max(copied, -(-(n + m) // bs) - full)  # the partial block's copy, then the growth
            if need > num_free:
                out.append((None, 0, 0))
                continue
            child = BlockTable(alloc, bs, copy_block)
            if need:
                num_free -= need
                new = free[num_free:][::-1]
                del free[num_free:]
                for b in new:
                    refs[b] = 1
                if partial:
                    copies.append((table.blocks[full], new[0]))
                child.blocks = table.blocks[:full] + new
            else:
                child.blocks = table.blocks[:full]
            if full:
                shared.append((first.setdefault(id(table), i), full))
            out.append((child, copied, need - copied))
        # the shared prefixes' new holders: one pass over a table's blocks per fork length, not per fork
        for (i, full), forks in collections.Counter(shared).items():
            for b in tables[i].blocks[:full]:
                refs[b] += forks
        self.copy_blocks(copies)
        return out

    def fork_rows(self, parents: Sequence[list[int]], parent_of: np.ndarray, num_tokens: np.ndarray,
                  new_tokens: np.ndarray) -> ForkRows:
        """`fork_tables` with the children as rows of arrays, not `BlockTable`s: fork i forks `parents[parent_of[i]]`
        (a block list) at `num_tokens[i]` and reserves `new_tokens[i]` more, where it fits (the same blocks,
        block for block, and the same free list and reference counts). Its Python is per parent and fork
        length, not per fork: the new blocks are one slice of the free list where all fit, the prefix
        counts raised once per (parent, length) by the number of its forks. The caller checks that each
        length is within its parent's blocks."""
        bs, alloc = self.block_size, self.allocator
        full, partial = np.divmod(num_tokens, bs)
        copied = (partial > 0).astype(np.int64)
        need = np.maximum(copied, -(-(num_tokens + new_tokens) // bs) - full)  # the copy, then the growth
        free, refs = alloc._free, alloc._refs
        if int(need.sum()) <= len(free):
            admitted = np.arange(len(need))
        else:  # a cache too small for all: each fork in order takes what it needs if that is left
            left, fits = len(free), []
            for x in need.tolist():
                fits.append(x <= left)
                left -= x if x <= left else 0
            admitted = np.flatnonzero(fits)
        full, copied, take, owner = full[admitted], copied[admitted], need[admitted], parent_of[admitted]
        total = int(take.sum())
        new = free[len(free) - total:][::-1]  # fork after fork, each its slice reversed: what `allocate` gives
        del free[len(free) - total:]
        for b in new:
            refs[b] = 1
        width = max(1, int((full + take).max(initial=0)))
        prefix_width = max((len(p) for p in parents), default=0)
        ptab = np.zeros((len(parents), max(prefix_width, width)), dtype=np.int32)
        for i, blocks in enumerate(parents):
            ptab[i, : len(blocks)] = blocks
        table = ptab[owner, :width]
        table[np.arange(width)[None, :] >= full[:, None]] = 0
        starts = np.cumsum(take) - take
        rows = np.repeat(np.arange(len(take)), take)
        table[rows, np.repeat(full - starts, take) + np.arange(total)] = new
        has_copy = np.flatnonzero(copied)
        self.copy_arrays(ptab[owner[has_copy], full[has_copy]], table[has_copy, full[has_copy]])
        # the shared prefixes' new holders: one pass over a parent's blocks per fork length, not per fork
        shared = full > 0
        keys, counts = np.unique(owner[shared] * (prefix_width + 1) + full[shared], return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist()):
            p, n = divmod(key, prefix_width + 1)
            for b in parents[p][:n]:
                refs[b] += count
        return ForkRows(admitted, table, full + take, copied, take - copied)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """`copy_block(src, dst)` for each (src, dst), as one indexed copy per layer (none of the dst may be
        a src); inside `deferred_copies`, at its end with the others."""
        if not pairs:
            return
        if self._deferred is not None:
            self._deferred.update((dst, src) for src, dst in pairs)
            return
        self._copy_indexed([dst for _, dst in pairs], [src for src, _ in pairs])

    def copy_arrays(self, src: np.ndarray, dst: np.ndarray) -> None:
        """`copy_blocks` of the pairs `(src[i], dst[i])`, given as arrays (no Python per pair unless inside
        `deferred_copies`)."""
        if not len(src):
            return
        if self._deferred is not None:
            self._deferred.update(zip(dst.tolist(), src.tolist()))
            return
        device = self.layers[0].device
        self._copy_tensors(torch.from_numpy(dst.astype(np.int64)).to(device),
                           torch.from_numpy(src.astype(np.int64)).to(device))

    def _copy_indexed(self, dst: list[int], src: list[int]) -> None:
        device = self.layers[0].device
        self._copy_tensors(torch.tensor(dst, dtype=torch.long, device=device),
                           torch.tensor(src, dtype=torch.long, device=device))

    def _copy_tensors(self, dst_t: torch.Tensor, src_t: torch.Tensor) -> None:
        for layer in self.layers:  # index_copy_ of a gathered copy: a third of `layer[:, dst] = layer[:, src]`'s time
            layer.index_copy_(1, dst_t, layer.index_select(1, src_t))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block `src` into block `dst` in every layer (keys and values); inside `deferred_copies`, at
        its end, together with the others."""
        if self._deferred is not None:
            self._deferred[dst] = src
            return
        for layer in self.layers:
            layer[:, dst].copy_(layer[:, src])

    @contextlib.contextmanager
    def deferred_copies(self) -> Iterator[None]:
        """Block copies requested inside (e.g. every fork of a pre-draft's branches) run at the end as one
        indexed copy per layer instead of one copy per block and layer (2048 forks x 16 layers at batch 64
        with 32 branches). Only for code that neither reads a copied block nor writes a source before the
        end; a block copied to twice keeps the last source (a dropped fork's block reused by the next)."""
        if self._deferred is not None:  # nested: the outer one flushes
            yield
            return
        self._deferred = {}
        try:
            yield
        finally:
            pending, self._deferred = self._deferred, None
            if pending:
                self._copy_indexed(list(pending), list(pending.values()))
