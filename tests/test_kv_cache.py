"""Block allocator, block tables, cache sizing, and the reference paged attention over the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from saguaro_vllm.drafter.attention import AttentionMetadata, reference_paged_attention, write_kv
from saguaro_vllm.drafter.kv_cache import (
    BlockAllocator,
    BlockTable,
    KVCacheConfig,
    OutOfBlocksError,
    PagedKVCache,
    kv_bytes_per_block,
    num_blocks_for_budget,
)


def test_allocator_exhaustion_is_all_or_nothing():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert len(set(first)) == 3 and alloc.num_free == 1
    with pytest.raises(OutOfBlocksError) as err:
        alloc.allocate(2)
    assert (err.value.needed, err.value.free) == (2, 1)
    assert alloc.num_free == 1
    alloc.free(first)
    assert alloc.num_free == 4
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]


def test_allocator_rejects_double_free():
    alloc = BlockAllocator(2)
    blocks = alloc.allocate(1)
    alloc.free(blocks)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free(blocks)
    (b,) = alloc.allocate(1)
    with pytest.raises(ValueError, match="freed twice"):  # a list holding it twice: one holder, two drops
        alloc.free([b, b])
    assert alloc.refcount(b) == 1  # checked before anything changed
    alloc.share([b])
    alloc.free([b, b])  # two holders: both go
    assert alloc.refcount(b) == 0 and alloc.num_free == 2


def test_block_table_grows_shrinks_and_maps_slots():
    cache = PagedKVCache(KVCacheConfig(num_blocks=6, block_size=4), 1, 1, 8, torch.float32, "cpu")
    alloc = cache.allocator
    alloc.free(list(reversed(alloc.allocate(6))))  # hand blocks out in a non-trivial order
    table = cache.new_block_table()
    table.ensure(9)  # 3 blocks
    assert len(table.blocks) == 3 and alloc.num_free == 3
    b = table.blocks
    assert table.slots(3, 6) == [b[0] * 4 + 3, b[1] * 4, b[1] * 4 + 1]
    table.ensure(12)  # still fits in 3 blocks
    assert alloc.num_free == 3
    table.shrink(5)
    assert table.blocks == b[:2] and alloc.num_free == 4
    table.shrink(0)
    assert table.blocks == [] and alloc.num_free == 6


def test_cache_layout_is_vllm_flash_layout():
    cache = PagedKVCache(KVCacheConfig(num_blocks=5, block_size=16), 3, 2, 64, torch.bfloat16, "cpu")
    assert len(cache.layers) == 3
    assert cache.layers[0].shape == (2, 5, 16, 2, 64) and cache.layers[0].dtype == torch.bfloat16


def test_num_blocks_for_budget():
    per_block = kv_bytes_per_block(2, 16, 2, 64, torch.float16)
    assert per_block == 2 * 2 * 16 * 2 * 64 * 2
    assert num_blocks_for_budget(10 * per_block + 1, 2, 16, 2, 64, torch.float16) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(per_block - 1, 2, 16, 2, 64, torch.float16)


def dense_causal_attention(q, k, v, scale):
    """q: [n, H, D] at the last n of L positions; k, v: [L, Hkv, D]."""
    n, num_heads, _ = q.shape
    k = k.repeat_interleave(num_heads // k.shape[1], dim=1)
    v = v.repeat_interleave(num_heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    L = k.shape[0]
    visible = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_reference_attention_matches_dense(block_size, heads):
    """Sequences with KV already cached plus new queries (1, 19, 33 tokens), scattered blocks."""
    num_heads, num_kv_heads = heads
    head_size, scale = 32, 0.17
    g = torch.Generator().manual_seed(0)
    cached, new = [0, 40, 7], [19, 1, 33]
    cache = PagedKVCache(KVCacheConfig(num_blocks=200, block_size=block_size), 1, num_kv_heads, head_size,
                         torch.float32, "cpu")
    blocks = cache.allocator.allocate(200)
    random.Random(0).shuffle(blocks)
    cache.allocator.free(blocks)
    tables, full_k, full_v, slots, lens = [], [], [], [], []
    for c, n in zip(cached, new, strict=True):
        table = cache.new_block_table()
        table.ensure(c + n)
        k = torch.randn(c + n, num_kv_heads, head_size, generator=g)
        v = torch.randn(c + n, num_kv_heads, head_size, generator=g)
        write_kv(k[:c], v[:c], cache.layers[0], torch.tensor(table.slots(0, c), dtype=torch.int64))
        tables.append(table.blocks)
        full_k.append(k)
        full_v.append(v)
        slots += table.slots(c, c + n)
        lens.append(c + n)
    starts = [0, 19, 20, 53]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        max_query_len=33,
        max_seq_len=max(lens),
    )
    q = torch.randn(53, num_heads, head_size, generator=g)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, cached, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, cached, strict=True)])
    out = reference_paged_attention(q, new_k, new_v, cache.layers[0], meta, scale)
    for s in range(3):
        ref = dense_causal_attention(q[starts[s] : starts[s + 1]], full_k[s], full_v[s], scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], ref, atol=1e-5, rtol=1e-5)


def test_deferred_copies_run_together_at_the_end():
    """Inside `deferred_copies` block copies wait, then run as one indexed copy per layer; a block copied
    to twice keeps the last source (a dropped fork's block reused by the next fork)."""
    import torch

    from saguaro_vllm.drafter.kv_cache import KVCacheConfig, PagedKVCache

    cache = PagedKVCache(KVCacheConfig(num_blocks=6, block_size=2), num_layers=2, num_kv_heads=1, head_size=3,
                         dtype=torch.float32, device="cpu")
    for layer in cache.layers:
        for b in range(6):
            layer[:, b] = float(b)
    with cache.deferred_copies():
        cache.copy_block(1, 4)
        cache.copy_block(2, 5)
        cache.copy_block(3, 5)  # the later copy into block 5 wins
        assert all((layer[:, 4] == 4).all() for layer in cache.layers)  # nothing copied yet
    for layer in cache.layers:
        assert (layer[:, 4] == 1).all() and (layer[:, 5] == 3).all() and (layer[:, 1] == 1).all()
    cache.copy_block(0, 4)  # outside: at once
    assert all((layer[:, 4] == 0).all() for layer in cache.layers)


def _forking_cache(seed: int) -> tuple[PagedKVCache, list]:
    """A 24-block cache (blocks of 4 tokens, handed out in a shuffled order, every element a distinct value)
    and three tables of 3, 9 and 12 tokens to fork from."""
    cache = PagedKVCache(KVCacheConfig(num_blocks=24, block_size=4), num_layers=2, num_kv_heads=1, head_size=2,
                         dtype=torch.float32, device="cpu")
    blocks = cache.allocator.allocate(24)
    random.Random(seed).shuffle(blocks)
    cache.allocator.free(blocks)
    for i, layer in enumerate(cache.layers):
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view_as(layer) + 1000 * i)
    parents = []
    for n in (3, 9, 12):
        table = cache.new_block_table()
        table.ensure(n)
        parents.append(table)
    return cache, parents


@pytest.mark.parametrize("seed", range(4))
def test_fork_tables_equal_fork_then_ensure_block_for_block(seed):
    """`fork_tables` (a pre-draft's forks at once) against `fork` then `ensure` one fork at a time, a fork whose
    growth does not fit freed again (what the branch admission did before): the same child tables, free list
    and reference counts, every child's blocks holding the same values, and the same copy and growth counts,
    in a cache too small for every fork."""
    rng = random.Random(seed)
    lengths = (3, 9, 12)
    forks = [(p, rng.randint(0, lengths[p]), rng.randint(0, 6)) for p in (rng.randrange(3) for _ in range(24))]
    ref_cache, ref_parents = _forking_cache(seed)
    ref = []
    for p, n, m in forks:
        alloc = ref_cache.allocator
        free = alloc.num_free
        try:
            child = ref_parents[p].fork(n)
        except OutOfBlocksError:
            ref.append((None, 0, 0))
            continue
        forked = alloc.num_free
        try:
            child.ensure(n + m, write_from=n)
        except OutOfBlocksError:
            child.shrink(0)
            ref.append((None, 0, 0))
            continue
        ref.append((child, free - forked, forked - alloc.num_free))
    cache, parents = _forking_cache(seed)
    got = cache.fork_tables([parents[p] for p, _, _ in forks], [n for _, n, _ in forks], [m for _, _, m in forks])
    assert any(c is None for c, _, _ in got) and any(c is not None for c, _, _ in got)  # some did not fit
    assert [(c and c.blocks, k, g) for c, k, g in got] == [(c and c.blocks, k, g) for c, k, g in ref]
    assert cache.allocator._free == ref_cache.allocator._free
    assert cache.allocator._refs == ref_cache.allocator._refs
    for (child, _, _), (p, n, _) in zip(got, forks, strict=True):
        if child is not None:
            for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
                assert torch.equal(layer[:, child.blocks], ref_layer[:, child.blocks])
    for child, _, _ in got:  # ordinary tables: freeing them and their parents leaves nothing behind
        if child is not None:
            child.shrink(0)
    for table in parents:
        table.shrink(0)
    assert cache.allocator.num_free == 24 and not any(cache.allocator._refs)


def test_free_many_equals_free_in_order():
    """`BlockAllocator.free_many` leaves the free list and counts `free` of each list in turn leaves; an
    over-free anywhere changes nothing."""
    def tables(alloc):
        a = alloc.allocate(5)
        alloc.share(a[:3])
        b = a[:3] + alloc.allocate(2)
        alloc.share(a[:1])
        c = a[:1] + alloc.allocate(1)
        return [b, a, c]

    ref, alloc = BlockAllocator(12), BlockAllocator(12)
    for blocks in tables(ref):
        ref.free(blocks)
    lists = tables(alloc)
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free_many(lists + [lists[2]])
    alloc.free_many(lists)
    assert alloc._free == ref._free and alloc._refs == ref._refs == [0] * 12


def test_block_rows_sync_of_many_rows_equals_row_by_row():
    """`BlockRows.sync` of many changed rows (one scatter) leaves the array row-by-row writes leave: longer,
    shorter and emptied tables, a widened array, released rows zeroed."""
    from saguaro_vllm.drafter.block_rows import BlockRows

    rng = random.Random(3)
    alloc = BlockAllocator(4096)
    tables = []
    for _ in range(40):
        t = BlockTable(alloc, 1)
        t.blocks = alloc.allocate(rng.randint(0, 9))
        tables.append(t)
    many, few = BlockRows(rows=8, width=4), BlockRows(rows=8, width=4)

    def same(a: np.ndarray, b: np.ndarray) -> bool:  # (widened in other steps, they may differ in width)
        w = min(a.shape[1], b.shape[1])
        return np.array_equal(a[:, :w], b[:, :w]) and not a[:, w:].any() and not b[:, w:].any()
    rows = [many.acquire() for _ in tables]
    assert [few.acquire() for _ in tables] == rows
    for round_ in range(4):
        many.sync(rows, tables)
        for i in range(0, len(tables), 7):  # under 8 rows: the row-by-row path
            few.sync(rows[i : i + 7], tables[i : i + 7])
        assert same(many.array, few.array) and many._written == few._written
        for t in tables:  # grow, shrink, empty, or keep
            k = rng.randrange(4)
            t.blocks = t.blocks + alloc.allocate(rng.randint(1, 40 if round_ == 2 else 3)) if k == 0 else \
                t.blocks[: rng.randint(0, len(t.blocks))] if k == 1 else [] if k == 2 else t.blocks
    many.release_many(rows[::2])
    for row in rows[::2]:
        few.release(row)
    assert same(many.array, few.array) and many._free == few._free
