"""Forked runner sequences: shared prefix blocks with reference counts, a private copy of the partial block,
copy-on-write for any write into a shared block, `adopt`, and no leaked blocks whatever the free order.
Every continuation is checked against the same tokens run from scratch on a fresh runner."""

from __future__ import annotations

import random

import numpy as np
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


def _parents(model, num_blocks=40, static_buckets=None) -> DraftModelRunner:
    """Three prefilled sequences of 7, 16 and 21 tokens (blocks of 16: fork points inside blocks and on block
    edges) on a runner whose blocks are handed out in a shuffled order."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=16), static_buckets=static_buckets)
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(alloc.num_free)
    random.Random(num_blocks).shuffle(blocks)
    alloc.free(blocks)
    for i, n in enumerate((7, 16, 21)):
        runner.add_request(f"p{i}")
        runner.forward([(f"p{i}", seq(n, 30 + i), 0)])
    return runner


def _state(runner: DraftModelRunner) -> dict:
    alloc = runner.kv_cache.allocator
    return {"free": list(alloc._free), "refs": list(alloc._refs),
            "seqs": {s: (list(r.block_table.blocks), r.num_computed, r.row) for s, r in runner._requests.items()}}


def test_fork_many_equals_fork_and_reserve(model):
    """`fork_many` against `fork` + `reserve` per fork (freed again when the reserve fails), in order, in a
    cache too small for all: the same sequences, blocks, block-table rows, free list and reference counts."""
    forks = [(f"p{p}", f"c{i}", n, m) for i, (p, n, m) in enumerate(
        [(0, 7, 4), (1, 16, 4), (2, 21, 30), (2, 5, 0), (1, 9, 12), (0, 3, 40), (2, 20, 4), (1, 16, 1),
         (0, 7, 9), (2, 21, 4), (1, 2, 4), (0, 0, 3)])]
    ref, runner = _parents(model, num_blocks=16), _parents(model, num_blocks=16)
    expected = []
    for parent, child, n, m in forks:
        free = ref.num_free_blocks
        try:
            ref.fork(parent, child, n)
        except OutOfBlocksError:
            expected.append(None)
            continue
        forked = ref.num_free_blocks
        try:
            ref.reserve(child, m)
        except OutOfBlocksError:
            ref.free_request(child)
            expected.append(None)
            continue
        expected.append((free - forked, forked - ref.num_free_blocks))
    got = runner.fork_many(forks)
    assert got == expected and None in got and any(got)
    assert _state(runner) == _state(ref)
    with pytest.raises(ValueError, match="already known"):
        runner.fork_many([("p0", "x", 1, 1), ("p0", "x", 2, 1)])
    with pytest.raises(ValueError, match="cannot fork 8 tokens"):
        runner.fork_many([("p0", "y", 1, 1), ("p0", "z", 8, 1)])
    assert _state(runner) == _state(ref)  # misuse changes nothing
    # free_many: free_request of each, in order
    gone = [f[1] for f, e in zip(forks, expected, strict=True) if e is not None][::-1] + ["p1"]
    for seq_id in gone:
        ref.free_request(seq_id)
    runner.free_many(gone)
    assert _state(runner) == _state(ref)
    with pytest.raises(ValueError, match="twice"):
        runner.free_many(["p0", "p0"])


@pytest.mark.parametrize("static_buckets", [None, (1, 2, 4, 8, 16)])
def test_forward_batch_equals_forward(model, static_buckets):
    """`forward_batch` (arrays, no Python per row) against `forward` of the same one-token chunks on an
    identical runner: the same logits bit for bit, KV, blocks and computed counts, over forks sharing prefix
    blocks at different lengths, all rows and subsets, rows that need a new block (it runs `forward`
    then), and state changed between forwards (read again); a freed sequence is refused."""
    runners = [_parents(model, static_buckets=static_buckets) for _ in range(2)]
    forks = [("p0", "a", 7, 3), ("p1", "b", 16, 5), ("p2", "c", 21, 9), ("p2", "d", 12, 2), ("p1", "e", 16, 0)]
    for r in runners:
        assert all(r.fork_many(forks))
    ref, runner = runners
    seqs = ["a", "b", "c", "d", "e", "p0"]
    batch = runner.decode_batch(seqs)
    g = torch.Generator().manual_seed(7)
    fallbacks, forward = [], runner.forward
    runner.forward = lambda chunks, *a, **kw: fallbacks.append(len(chunks)) or forward(chunks, *a, **kw)
    for step, live in enumerate([None, None, [0, 2, 3], None, [1, 4], None, [5, 0], None]):
        ids = seqs if live is None else [seqs[i] for i in live]
        tokens = torch.randint(2, 300, (len(ids),), generator=g).tolist()
        if step == 4:  # state changed outside the batch, on both runners alike
            for r in runners:
                r.truncate("c", r.num_computed("c") - 2)
                DraftModelRunner.forward(r, [("d", [9], r.num_computed("d"))])
        expected = ref.forward([(s, [t], ref.num_computed(s)) for s, t in zip(ids, tokens, strict=True)])
        got = runner.forward_batch(batch, np.array(tokens), None if live is None else np.array(live))
        assert torch.equal(got, expected), step
        assert _state(runner) == _state(ref)
    assert fallbacks == [6]  # step 0 only: "e" (forked at a block edge, no room reserved) needed a block
    for seq_id, req in ref._requests.items():  # every sequence's KV
        slots = req.block_table.slots(0, req.num_computed)
        for a, b in zip(ref.kv_cache.layers, runner.kv_cache.layers, strict=True):
            assert torch.equal(a.flatten(1, 2)[:, slots], b.flatten(1, 2)[:, slots])
    if static_buckets:
        assert runner.static.runs and sum(runner.static.runs.values()) == sum(ref.static.runs.values())
    runner.free_request("b")
    with pytest.raises(ValueError, match="freed or adopted"):
        runner.forward_batch(batch, np.array([1] * len(seqs)))
    with pytest.raises(ValueError, match="twice"):
        runner.decode_batch(["a", "a"])


def test_drafter_delay_aid_slows_every_forward_once(monkeypatch):
    """`SAGUARO_DRAFTER_DELAY_S` (server._slow_down) delays both kinds of forward, branch steps included, and
    `forward_batch` running `forward` for rows without room only once."""
    from saguaro_vllm.drafter import server

    sleeps: list[float] = []
    monkeypatch.setattr(server.time, "sleep", sleeps.append)

    class Runner:
        def forward(self, chunks):
            return "forward"

        def forward_batch(self, batch, tokens, live=None):
            return self.forward([])

    runner = Runner()
    server._slow_down(runner, 0.25)
    assert runner.forward([]) == "forward" and runner.forward_batch(None, None) == "forward"
    assert sleeps == [0.25, 0.25]
