"""Fork groups (`DraftModelRunner.fork_group`): a pre-draft's branches as rows of arrays instead of runner
sequences. Against the per-fork path on an identical runner: the same admitted forks, blocks, free list and
reference counts (`fork_many`), the same drafted tokens, logits and KV bit for bit (`reference_branches`) at
several batches, fan-outs, fork points and in a nearly full cache; a fork made a sequence on first use
(adopted, fed a chunk) continues exactly; releasing forks in bulk returns every block in the order
`free_request` one by one would; a released fork id is refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from branch_runs import reference_branches

from saguaro_vllm.drafter.branches import BranchRoot, BranchRun
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner


@pytest.fixture(scope="module")
def model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make_runner(model, num_blocks: int, block_size: int, seed: int, static_buckets=None) -> DraftModelRunner:
    """A runner whose blocks are handed out in a shuffled order (scattered tables)."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size),
                              static_buckets=static_buckets)
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(alloc.num_free)
    random.Random(seed).shuffle(blocks)
    alloc.free(blocks)
    return runner


def prefilled(model, batch: int, k: int, seed: int, num_blocks: int, block_size: int = 16, static_buckets=None):
    """`batch` requests of random lengths, each with KV for its context and k drafts (glued): roots ready for
    branches at every depth 0..k."""
    runner = make_runner(model, num_blocks, block_size, seed, static_buckets)
    rng = random.Random(seed)
    roots = []
    for i in range(batch):
        n = rng.randint(1, 3 * block_size)
        tokens = [rng.randrange(2, 300) for _ in range(n + k)]
        runner.add_request(f"r{i}")
        runner.forward([(f"r{i}", tokens, 0)])
        roots.append(BranchRoot(f"r{i}", n, tuple(tokens[n:])))
    return runner, roots


def candidates_for(roots, fanout: int, seed: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(seed)
    return [[(d, b) for d, b in rng.sample([(d, b) for d in range(r.k + 1) for b in range(2, 40)], fanout)]
            for r in roots]


def state(runner: DraftModelRunner) -> tuple[list[int], list[int]]:
    alloc = runner.kv_cache.allocator
    return list(alloc._free), list(alloc._refs)


def all_free(runner: DraftModelRunner) -> bool:
    alloc = runner.kv_cache.allocator
    return alloc.num_free == alloc.num_blocks - (runner.static is not None) and \
        sum(alloc._refs) == (runner.static is not None)


def assert_same_kv(ref: DraftModelRunner, runner: DraftModelRunner, seq_ids) -> None:
    for seq_id in seq_ids:
        a, b = ref._get(seq_id), runner._get(seq_id)
        assert a.block_table.blocks == b.block_table.blocks and a.num_computed == b.num_computed, seq_id
        slots = a.block_table.slots(0, a.num_computed)
        for x, y in zip(ref.kv_cache.layers, runner.kv_cache.layers, strict=True):
            assert torch.equal(x.flatten(1, 2)[:, slots], y.flatten(1, 2)[:, slots]), seq_id


@pytest.mark.parametrize(("batch", "fanout", "block_size", "num_blocks"), [
    (1, 1, 16, 64), (1, 9, 8, 64), (5, 4, 16, 128), (12, 6, 16, 256), (12, 6, 8, 90), (7, 12, 4, 120)])
def test_fork_group_equals_fork_many(model, batch, fanout, block_size, num_blocks):
    """The same forks admitted (a cache too small for all leaves out the same ones), the same blocks per fork
    and the same free list, reference counts and copied blocks' contents as `fork_many`."""
    k = 3
    ref, roots = prefilled(model, batch, k, batch, num_blocks, block_size)
    runner, _ = prefilled(model, batch, k, batch, num_blocks, block_size)
    rng = random.Random(fanout)
    forks = [(r, f"f{i}", roots[r].context_len + rng.randint(0, k), rng.randint(0, 6))
             for i, r in enumerate(rng.randrange(batch) for _ in range(batch * fanout))]
    expected = ref.fork_many([(roots[r].req_id, c, n, m) for r, c, n, m in forks])
    group = runner.fork_group([r.req_id for r in roots], [c for _, c, _, _ in forks],
                              np.array([r for r, _, _, _ in forks]), np.array([n for _, _, n, _ in forks]),
                              np.array([m for _, _, _, m in forks]))
    assert group.admitted.tolist() == [i for i, e in enumerate(expected) if e is not None]
    assert [(int(c), int(g)) for c, g in zip(group.copied, group.grown, strict=True)] == [e for e in expected if e]
    if num_blocks in (90, 120):  # nearly full: some forks left out
        assert len(group) < len(forks)
    assert state(runner) == state(ref)
    for i, child in enumerate(group.ids):
        assert group.table[i, : group.num_blocks[i]].tolist() == ref._get(child).block_table.blocks
        assert not group.table[i, group.num_blocks[i]:].any()  # the padding the attention kernels expect
        assert runner.num_computed(child) == ref.num_computed(child) and runner.has_request(child)
    assert_same_kv(ref, runner, group.ids)  # (made sequences here: the group is spent)


@pytest.mark.parametrize(("batch", "fanout", "steps", "num_blocks", "static"), [
    (1, 3, 4, 64, False), (4, 8, 3, 160, False), (9, 5, 2, 200, True), (9, 7, 3, 60, False), (16, 2, 5, 70, True)])
def test_branch_runs_on_groups_equal_the_reference(model, batch, fanout, steps, num_blocks, static):
    """`BranchRun` (one fork group, one `forward_batch` of its rows per step) against one fork, reserve and
    chunk per branch: the same branches, tokens and logits bit for bit, then the same blocks, free list,
    reference counts and KV; releasing everything leaves every block free."""
    k = 4
    buckets = (1, 2, 4, 8, 16, 32, 64) if static else None
    ref, roots = prefilled(model, batch, k, 7 * batch, num_blocks, static_buckets=buckets)
    runner, _ = prefilled(model, batch, k, 7 * batch, num_blocks, static_buckets=buckets)
    candidates = candidates_for(roots, fanout, batch)
    expected, ref_logits, _ = reference_branches(ref, roots, candidates, num_steps=steps)
    run = BranchRun(runner, roots, candidates, num_steps=steps, keep_logits=True)
    while not run.done:
        run.step()
    got = run.finish()
    assert [(b.req_id, b.depth, b.bonus, b.seq_id) for b in got] == \
        [(b.req_id, b.depth, b.bonus, b.seq_id) for b in expected]
    if num_blocks in (60, 70):  # nearly full: the least likely candidates left out
        assert run.dropped > 0
    for b, r, logits in zip(got, expected, ref_logits, strict=True):
        assert b.tokens == r.tokens and len(b.tokens) == steps
        assert torch.equal(b.logits, torch.stack(logits))
        assert runner.num_computed(b.seq_id) == ref.num_computed(r.seq_id)
    assert state(runner) == state(ref)
    if static:
        assert runner.static.runs
    ids = [b.seq_id for b in got]
    runner.free_many(ids[::2])  # in bulk, from the group
    for seq_id in ids[::2]:
        ref.free_request(seq_id)
    assert state(runner) == state(ref)  # the free list, block for block, of one `free_request` after another
    assert_same_kv(ref, runner, ids[1::2])
    for b in got[1::2]:
        runner.free_request(b.seq_id)
    for r in roots:
        runner.free_request(r.req_id)
    assert all_free(runner)


def test_a_fork_made_a_sequence_continues_exactly(model):
    """Forks become ordinary sequences on first use (a chunk fed to one, `adopt`, `truncate`) and continue as
    the per-fork reference does; the rest of the group runs on, and then every block comes back."""
    k, steps = 3, 3
    ref, roots = prefilled(model, 4, k, 3, 200)
    runner, _ = prefilled(model, 4, k, 3, 200)
    candidates = candidates_for(roots, 5, 1)
    expected, ref_logits, _ = reference_branches(ref, roots, candidates, num_steps=steps, max_steps=1)
    run = BranchRun(runner, roots, candidates, num_steps=steps)
    run.step()
    first = run.finish()
    assert [b.tokens for b in first] == [b.tokens for b in expected]
    # one fork fed outside the run (a sequence from now on), one truncated; the run's next step runs them
    # all through `forward` then, and its tokens still equal the reference's
    fed, cut = first[0], first[3]
    for r in (ref, runner):
        r.forward([(fed.seq_id, [fed.tokens[-1]], r.num_computed(fed.seq_id))])
        r.truncate(cut.seq_id, r.num_computed(cut.seq_id) - 1)
    assert runner.has_request(fed.seq_id) and fed.seq_id in runner._requests
    assert runner._get(fed.seq_id).block_table.blocks == ref._get(fed.seq_id).block_table.blocks
    # the others: one more token each, in a batched step, exactly as one forward of chunks
    live = [b for b in first if b is not fed and b is not cut]
    chunks = [(b.seq_id, [b.tokens[-1]], ref.num_computed(b.seq_id)) for b in live]
    want = ref.forward(chunks)
    rows = np.array([run._rows[first.index(b)] for b in live])
    assert torch.equal(runner.forward_batch(run._group, np.array([b.tokens[-1] for b in live]), rows), want)
    assert state(runner) == state(ref)
    # a hit: the request adopts its branch and goes on like the reference
    hit = live[1]
    for r in (ref, runner):
        r.adopt(hit.seq_id, hit.req_id)
        assert not r.has_request(hit.seq_id)
    at = ref.num_computed(hit.req_id)
    assert runner.num_computed(hit.req_id) == at
    for token in (5, 6):
        assert torch.equal(runner.forward([(hit.req_id, [token], at)]), ref.forward([(hit.req_id, [token], at)]))
        at += 1
    assert state(runner) == state(ref)
    # a fork of a fork (its parent made a sequence first), fed a chunk
    parent = live[2]
    for r in (ref, runner):
        r.fork(parent.seq_id, "grandchild", r.num_computed(parent.seq_id) - 1)
    at = ref.num_computed("grandchild")
    assert torch.equal(runner.forward([("grandchild", [7, 8], at)], num_logits=2),
                       ref.forward([("grandchild", [7, 8], at)], num_logits=2))
    assert state(runner) == state(ref)
    assert_same_kv(ref, runner, [hit.req_id, fed.seq_id, cut.seq_id, live[0].seq_id, parent.seq_id, "grandchild"])
    assert runner._groups  # the other forks are still the group's
    # the rest in bulk, materialised and group forks interleaved: `free_request` one after another
    rest = [b.seq_id for b in first if b is not hit] + ["grandchild"]
    random.Random(0).shuffle(rest)
    runner.free_many(rest)
    for seq_id in rest:
        ref.free_request(seq_id)
    assert state(runner) == state(ref)
    for r in roots:
        runner.free_request(r.req_id)
    assert all_free(runner) and not runner._groups


def test_released_forks_are_refused(model):
    runner, roots = prefilled(model, 2, 2, 5, 64)
    run = BranchRun(runner, roots, [[(0, 3), (1, 4), (2, 5)], [(2, 6)]])
    run.step()
    branches = run.finish()
    gone = branches[1].seq_id
    runner.free_request(gone)
    assert not runner.has_request(gone)
    assert runner.held(["nope", branches[2].seq_id, gone, "r1", branches[0].seq_id]) == \
        [branches[2].seq_id, "r1", branches[0].seq_id]  # `has_request` of each, in order
    for use in (runner.num_computed, runner.free_request, lambda s: runner.adopt(s, "r0"),
                lambda s: runner.forward([(s, [1], 3)]), lambda s: runner.free_many([s])):
        with pytest.raises(KeyError, match="unknown to the draft runner"):
            use(gone)
    with pytest.raises(ValueError, match="freed or adopted"):
        runner.forward_batch(run._group, np.array([1, 2, 3, 4]))
    with pytest.raises(ValueError, match="already known"):  # a live fork's id is taken
        runner.fork_group(["r0"], [branches[0].seq_id], np.array([0]), np.array([1]), np.array([1]))
    with pytest.raises(ValueError, match="cannot fork 99 tokens"):
        runner.fork_group(["r0"], ["new"], np.array([0]), np.array([99]), np.array([1]))
    runner.free_many([b.seq_id for b in branches if b.seq_id != gone])
    # the id can be a fork again once released
    again = runner.fork_group(["r0"], [gone], np.array([0]), np.array([2]), np.array([1]))
    assert len(again) == 1 and runner.num_computed(gone) == 2
    runner.free_request(gone)
    for r in roots:
        runner.free_request(r.req_id)
    assert all_free(runner) and not runner._groups


def test_forward_batch_of_a_group_runs_forward_where_it_must(model):
    """Rows with no room of their own (a fork at a block edge with nothing reserved) or no longer the group's
    (made a sequence) go through `forward` as the step's chunks: the same logits, blocks and KV as forward of
    those chunks on an identical runner, and the group's other rows go on from its arrays."""
    ref, roots = prefilled(model, 2, 2, 11, 64)
    runner, _ = prefilled(model, 2, 2, 11, 64)
    assert roots[0].context_len >= 16
    forks = [(0, "a", 16, 0), (1, "b", roots[1].context_len, 3), (0, "c", roots[0].context_len + 1, 2)]
    ref.fork_many([(roots[p].req_id, c, n, m) for p, c, n, m in forks])
    group = runner.fork_group([r.req_id for r in roots], [f[1] for f in forks], np.array([f[0] for f in forks]),
                              np.array([f[2] for f in forks]), np.array([f[3] for f in forks]))
    g = torch.Generator().manual_seed(3)
    calls, forward = [], runner.forward
    runner.forward = lambda chunks, *a, **kw: calls.append(len(chunks)) or forward(chunks, *a, **kw)
    for step, live in enumerate([[1, 2], [2], [2, 1], [0], None]):
        rows = [0, 1, 2] if live is None else live
        if step == 2:  # "b" made a sequence outside the group (a truncate), on both runners
            for r in (ref, runner):
                r.truncate("b", r.num_computed("b") - 1)
        ids = [forks[i][1] for i in rows]
        tokens = torch.randint(2, 300, (len(ids),), generator=g).tolist()
        want = ref.forward([(s, [t], ref.num_computed(s)) for s, t in zip(ids, tokens, strict=True)])
        got = runner.forward_batch(group, np.array(tokens), None if live is None else np.array(live))
        assert torch.equal(got, want), step
        assert state(runner) == state(ref)
        assert [runner.num_computed(s) for s in ids] == [ref.num_computed(s) for s in ids]
    assert calls == [2, 1, 3]  # from the step with a row made a sequence ("b"), and for "a" (no room)
    assert_same_kv(ref, runner, ["a", "b", "c"])
    runner.free_many(["c", "a", "b", "r0", "r1"])
    assert all_free(runner)


@pytest.mark.parametrize("parents_first", [False, True])
def test_bulk_release_is_free_request_one_after_another(model, parents_first):
    """`free_many` of many group forks (`BlockAllocator.free_rows`) in any order leaves the free list, block for
    block, and the reference counts of `free_request` of each in turn, also where the parents went first (the
    shared prefix blocks then return at their last fork); an over-free raises and changes nothing."""
    ref, roots = prefilled(model, 6, 3, 21, 400)
    runner, _ = prefilled(model, 6, 3, 21, 400)
    rng = random.Random(2)
    forks = [(r, f"f{i}", roots[r].context_len + rng.randint(0, 3), rng.randint(0, 20))
             for i, r in enumerate(rng.randrange(6) for _ in range(120))]
    ref.fork_many([(roots[r].req_id, c, n, m) for r, c, n, m in forks])
    group = runner.fork_group([r.req_id for r in roots], [f[1] for f in forks], np.array([f[0] for f in forks]),
                              np.array([f[2] for f in forks]), np.array([f[3] for f in forks]))
    assert len(group) == len(forks)
    if parents_first:
        for r in (ref, runner):
            r.free_many([root.req_id for root in roots])
    ids = [f[1] for f in forks]
    rng.shuffle(ids)
    alloc = runner.kv_cache.allocator
    before = state(runner)
    with pytest.raises(ValueError, match="freed twice"):  # the table of a fork whose blocks went already
        alloc.free_rows(group.table[[*range(len(group)), 0]], group.num_blocks[[*range(len(group)), 0]])
    assert state(runner) == before
    runner.free_many(ids[:90])
    for seq_id in ids[:90]:
        ref.free_request(seq_id)
    assert state(runner) == state(ref)
    assert_same_kv(ref, runner, ids[90:])
    runner.free_many(ids[90:] + ([] if parents_first else [root.req_id for root in roots]))
    assert all_free(runner) and not runner._groups
