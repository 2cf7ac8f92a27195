"""Block allocator, block tables, cache sizing, and the reference paged attention over the cache."""

from __future__ import annotations

import random

import pytest
import torch

from saguaro_vllm.drafter.attention import AttentionMetadata, reference_paged_attention, write_kv
from saguaro_vllm.drafter.kv_cache import (
    BlockAllocator,
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
