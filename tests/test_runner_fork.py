"""Forked runner sequences: shared prefix blocks with reference counts, a private copy of the partial block,
copy-on-write for any write into a shared block, `adopt`, and no leaked blocks whatever the free order.
Every continuation is checked against the same tokens run from scratch on a fresh runner."""

from __future__ import annotations

import random

import pytest
import torch

from saguaro_vllm.drafter.kv_cache import (
    BlockAllocator,
    KVCacheConfig,
    OutOfBlocksError,
)
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner

TOL = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture(scope="module")
def model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make_runner(model, num_blocks=32, block_size=16) -> DraftModelRunner:
    """Blocks handed out in a shuffled order, so block tables are scattered."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size))
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(num_blocks)
    random.Random(num_blocks + block_size).shuffle(blocks)
    alloc.free(blocks)
    return runner


def seq(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh(model, tokens: list[int], n: int = 1) -> torch.Tensor:
    """Logits of the last `n` tokens, computed from scratch on a fresh runner."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=16, block_size=16))
    runner.add_request("ref")
    return runner.forward([("ref", tokens, 0)], num_logits=n)


def block_ids(runner: DraftModelRunner, req_id: str) -> list[int]:
    """The sequence's blocks in logical order (a copy of the runner's own table)."""
    return list(runner._get(req_id).block_table.blocks)


def all_free(runner: DraftModelRunner) -> bool:
    alloc = runner.kv_cache.allocator
    return alloc.num_free == alloc.num_blocks and all(alloc.refcount(b) == 0 for b in range(alloc.num_blocks))


def test_allocator_refcounts():
    alloc = BlockAllocator(3)
    a = alloc.allocate(2)
    alloc.share(a)
    assert [alloc.refcount(b) for b in a] == [2, 2] and alloc.num_free == 1
    alloc.free(a)
    assert alloc.num_free == 1
    with pytest.raises(ValueError, match="freed twice"):
        alloc.free([a[0], a[0]])  # checked in full first: nothing changes
    assert alloc.refcount(a[0]) == 1
    alloc.free(a)
    assert alloc.num_free == 3
    with pytest.raises(ValueError, match="shared while free"):
        alloc.share(a)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("fork_at", [0, 7, 16, 32, 40])
def test_fork_shares_full_blocks_and_copies_the_partial_one(model, block_size, fork_at):
    runner = make_runner(model, block_size=block_size)
    tokens = seq(40, 1)
    runner.add_request("p")
    runner.forward([("p", tokens, 0)])
    parent_blocks = block_ids(runner, "p")
    free_before = runner.num_free_blocks
    runner.fork("p", "c", fork_at)
    full, partial = divmod(fork_at, block_size)
    child_blocks = block_ids(runner, "c")
    assert child_blocks[:full] == parent_blocks[:full] and runner.num_computed("c") == fork_at
    assert len(child_blocks) == full + (1 if partial else 0)
    assert runner.num_free_blocks == free_before - (1 if partial else 0)
    if partial:
        assert child_blocks[-1] not in parent_blocks
    alloc = runner.kv_cache.allocator
    assert all(alloc.refcount(b) == 2 for b in child_blocks[:full])

    # Both sides continue on their own, and each equals its tokens run from scratch.
    branch = seq(20, 2)
    out_c = runner.forward([("c", branch, fork_at)], num_logits=3)
    torch.testing.assert_close(out_c, fresh(model, tokens[:fork_at] + branch, 3), **TOL)
    more = seq(5, 3)
    out_p = runner.forward([("p", more, 40)], num_logits=2)
    torch.testing.assert_close(out_p, fresh(model, tokens + more, 2), **TOL)
    assert block_ids(runner, "p")[: len(parent_blocks)] == parent_blocks  # parent never copied anything

    runner.free_request("p")
    runner.free_request("c")
    assert all_free(runner)


def test_siblings_and_free_orders_never_leak(model):
    """Parent freed first while children live; children forked from children; batched child steps."""
    runner = make_runner(model, num_blocks=40)
    tokens = seq(37, 4)
    runner.add_request("p")
    runner.forward([("p", tokens, 0)])
    for i, at in enumerate([37, 33, 16, 20]):
        runner.fork("p", f"c{i}", at)
    runner.fork("c1", "g", 30)  # a grandchild, forked before c1 writes anything
    runner.free_request("p")
    expect = {"c0": 37, "c1": 33, "c2": 16, "c3": 20, "g": 30}
    ext = {name: seq(3 + i, 10 + i) for i, name in enumerate(expect)}
    out = runner.forward([(name, ext[name], at) for name, at in expect.items()])
    ref = torch.cat([fresh(model, tokens[:at] + ext[name]) for name, at in expect.items()])
    torch.testing.assert_close(out, ref, **TOL)
    for name in ["c2", "g", "c0", "c3", "c1"]:
        runner.free_request(name)
    assert all_free(runner)


def test_adopt_keeps_the_child_and_releases_the_rest(model):
    runner = make_runner(model)
    tokens = seq(45, 5)
    runner.add_request("p")
    runner.forward([("p", tokens, 0)])
    runner.fork("p", "hit", 35)
    runner.fork("p", "other", 21)
    branch = seq(4, 6)
    runner.forward([("hit", branch, 35)])
    runner.adopt("hit", "p")
    assert not runner.has_request("hit") and runner.num_computed("p") == 39
    alloc = runner.kv_cache.allocator
    # Blocks of the old parent past the shared prefix are gone; the prefix stays, shared with "other".
    assert alloc.num_free == alloc.num_blocks - 3 - 1  # p: 3 blocks (1 copied); other: 1 shared + 1 copied
    nxt = seq(2, 7)
    out = runner.forward([("p", nxt, 39)])
    torch.testing.assert_close(out, fresh(model, tokens[:35] + branch + nxt), **TOL)
    runner.free_request("p")
    runner.free_request("other")
    assert all_free(runner)
    with pytest.raises(ValueError, match="adopt itself"):
        runner.add_request("x")
        runner.adopt("x", "x")


def test_writes_into_a_shared_block_copy_it_first(model):
    """Truncating into the shared prefix and writing there (either side) must not touch the other side."""
    runner = make_runner(model)
    tokens = seq(40, 8)
    runner.add_request("p")
    runner.forward([("p", tokens, 0)])
    runner.fork("p", "c", 32)  # two full blocks shared
    runner.truncate("p", 10)  # into shared block 0
    new_p = seq(6, 9)
    free_before = runner.num_free_blocks
    out_p = runner.forward([("p", new_p, 10)])
    assert runner.num_free_blocks == free_before - 1  # block 0 copied; block 1 was let go by the truncate
    torch.testing.assert_close(out_p, fresh(model, tokens[:10] + new_p), **TOL)
    new_c = seq(3, 10)
    out_c = runner.forward([("c", new_c, 32)])
    torch.testing.assert_close(out_c, fresh(model, tokens[:32] + new_c), **TOL)
    runner.truncate("c", 20)  # p copied block 0 away, so c is now its only holder: writes go in place
    free_before = runner.num_free_blocks
    runner.reserve("c", 4)
    assert runner.num_free_blocks == free_before
    runner.free_request("p")
    runner.free_request("c")
    assert all_free(runner)


def test_out_of_blocks_changes_nothing(model):
    runner = make_runner(model, num_blocks=3)
    runner.add_request("p")
    runner.forward([("p", seq(40, 11), 0)])  # 3 blocks, none free
    with pytest.raises(OutOfBlocksError):
        runner.fork("p", "c", 20)  # needs one block for the partial copy
    assert not runner.has_request("c") and runner.num_free_blocks == 0
    runner.fork("p", "c", 32)  # full blocks only: free
    runner.truncate("c", 8)
    with pytest.raises(OutOfBlocksError):
        runner.forward([("c", [5], 8)])  # would write a shared block: needs a copy, none free
    with pytest.raises(OutOfBlocksError):
        runner.reserve("c", 1)
    assert runner.num_computed("c") == 8 and runner.num_free_blocks == 0
    runner.free_request("p")
    runner.forward([("c", [5], 8)])  # now c is the block's only holder: in place
    runner.free_request("c")
    assert all_free(runner)


def test_fork_misuse_is_reported(model):
    runner = make_runner(model)
    runner.add_request("p")
    runner.forward([("p", seq(5, 12), 0)])
    with pytest.raises(ValueError, match="cannot fork 6 tokens"):
        runner.fork("p", "c", 6)
    with pytest.raises(KeyError, match="unknown"):
        runner.fork("nope", "c", 1)
    runner.fork("p", "c", 5)
    with pytest.raises(ValueError, match="already known"):
        runner.fork("p", "c", 5)
