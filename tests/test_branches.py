"""The multi-branch draft step: every branch (every depth 0..K, several requests, scattered block tables) drafts
exactly what its tokens give when run alone as a plain chain on a fresh runner, greedy and sampled; the
bonus distributions SyncDrafter keeps plus the glue's equal the chain's; a full cache drops the least likely
branches; a hit branch adopted by its request continues exactly; nothing leaks."""

from __future__ import annotations

import random

import pytest
import torch
from branch_runs import bonus_distributions, draft_branches, glue, reference_branches

from saguaro_vllm.drafter.branches import BranchRoot, BranchRun
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.predictor import select_candidates
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.sampling import sample_proposals
from saguaro_vllm.drafter.sync_drafter import SyncDrafter
from saguaro_vllm.ops import proposal_probs
from saguaro_vllm.shared.proposal_buffers import ProposalRing
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

K = 4
TOL = {"atol": 2e-5, "rtol": 1e-4}
# Context lengths chosen so that forks land on block boundaries (L + j = 16 or 32) as well as inside blocks.
CONTEXT_LENS = {"a": 5, "b": 14, "c": 16, "d": 28, "e": 29}
FANOUT = [2, 2, 1, 1, 2]  # depths 0..K


@pytest.fixture(scope="module")
def model(tiny_pair):
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def make_runner(model, num_blocks: int, block_size: int) -> DraftModelRunner:
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=block_size))
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(num_blocks)
    random.Random(block_size).shuffle(blocks)
    alloc.free(blocks)
    return runner


def contexts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {rid: torch.randint(2, 300, (n,), generator=g).tolist() for rid, n in CONTEXT_LENS.items()}


def chain(model, tokens: list[int], steps: int, forced: list[int] | None = None):
    """Reference: `tokens` then `steps` greedy (or `forced`) tokens, one sequence alone on a fresh runner.
    Returns (drafted tokens, logits [steps, vocab])."""
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=16, block_size=16))
    runner.add_request("ref")
    feed, out, rows = list(tokens), [], []
    for s in range(steps):
        start = runner.num_computed("ref")
        logits = runner.forward([("ref", feed[start:], start)])[0]
        rows.append(logits)
        out.append(forced[s] if forced else int(logits.argmax()))
        feed.append(out[-1])
    return out, torch.stack(rows)


def drafted_roots(model, runner, spec: SamplingSpec):
    """SyncDrafter drafts K tokens per request and keeps the logits; returns (drafter, roots, contexts)."""
    ctx = contexts()
    ring = ProposalRing.create(rows=len(ctx), k=K, vocab=model.config.vocab_size)  # for sampled drafts' q
    drafter = SyncDrafter(runner, vocab_size=model.config.vocab_size, keep_logits=True, probs_ring=ring)
    rows = [RowUpdate(rid, 0, toks, K, spec) for rid, toks in ctx.items()]
    resp = drafter.step(StepRequest(1, rows, []))
    roots = [BranchRoot(rid, len(ctx[rid]), tuple(d)) for rid, d in zip(ctx, resp.drafts, strict=True)]
    assert all(len(r.drafts) == K for r in roots)
    return drafter, roots, ctx


@pytest.mark.parametrize("block_size", [16, 32])
def test_every_branch_equals_its_chain_alone(model, block_size):
    runner = make_runner(model, num_blocks=160, block_size=block_size)
    drafter, roots, ctx = drafted_roots(model, runner, SamplingSpec())
    depth_k = glue(runner, roots)
    candidates = []
    for r, root in enumerate(roots):
        dists = bonus_distributions(drafter.reqs[root.req_id].draft_logits, depth_k[r])
        for j in range(K + 1):  # the depth-j distribution is the chain's after context + x1..xj
            _, ref = chain(model, ctx[root.req_id] + list(root.drafts[:j]), 1)
            torch.testing.assert_close(dists[j], ref[0], **TOL)
        candidates.append(select_candidates(dists, root.drafts, FANOUT))
    branches = draft_branches(runner, roots, candidates, keep_logits=True)

    assert [(b.req_id, b.depth, b.bonus) for b in branches] == [
        (root.req_id, j, t) for root, cands in zip(roots, candidates, strict=True) for j, t in cands]
    assert {b.depth for b in branches} == set(range(K + 1))
    lens = {r.req_id: r.context_len for r in roots}
    drafts = {r.req_id: list(r.drafts) for r in roots}
    for b in branches:
        prefix = ctx[b.req_id] + drafts[b.req_id][: b.depth] + [b.bonus]
        ref_tokens, ref_logits = chain(model, prefix, K)
        assert b.tokens == ref_tokens, (b.req_id, b.depth, b.bonus)
        torch.testing.assert_close(b.logits, ref_logits, **TOL)
        assert b.probs is None
        assert runner.num_computed(b.seq_id) == lens[b.req_id] + b.depth + K

    # The roots are untouched by their branches: they continue like their own chains.
    out = runner.forward([(r.req_id, [7], r.context_len + K) for r in roots])
    for row, r in zip(out, roots, strict=True):
        _, ref = chain(model, ctx[r.req_id] + drafts[r.req_id] + [7], 1)
        torch.testing.assert_close(row, ref[0], **TOL)

    # A hit: the first branch of each request becomes the request's sequence and continues exactly.
    for r in roots:
        hit = next(b for b in branches if b.req_id == r.req_id)
        for b in branches:
            if b.req_id == r.req_id and b is not hit:
                runner.free_request(b.seq_id)
        runner.adopt(hit.seq_id, r.req_id)
        at = r.context_len + hit.depth + K
        assert runner.num_computed(r.req_id) == at
        out = runner.forward([(r.req_id, [hit.tokens[-1]], at)])
        _, ref = chain(model, ctx[r.req_id] + drafts[r.req_id][: hit.depth] + [hit.bonus] + hit.tokens, 1)
        torch.testing.assert_close(out[0], ref[0], **TOL)
        drafter.free(r.req_id)
    assert runner.num_free_blocks == 160


@pytest.mark.parametrize("block_size", [8, 16])
def test_branch_run_counts_fork_copies_and_growth_blocks(model, block_size):
    """A fork at n tokens copies the partial block (n not a multiple of the block size) and reserves
    ceil((n + K) / B) - ceil(n / B) blocks for its K tokens; the run reports both, and they are every block
    it took."""
    runner = make_runner(model, num_blocks=160, block_size=block_size)
    drafter, roots, _ = drafted_roots(model, runner, SamplingSpec())
    depth_k = glue(runner, roots)
    candidates = [select_candidates(bonus_distributions(drafter.reqs[r.req_id].draft_logits, depth_k[i]),
                                    r.drafts, FANOUT) for i, r in enumerate(roots)]
    free = runner.num_free_blocks
    run = BranchRun(runner, roots, candidates)
    forks = [r.context_len + j for r, cands in zip(roots, candidates, strict=True) for j, _ in cands]
    assert run.fork_copies == sum(1 for n in forks if n % block_size) > 0
    assert run.growth_blocks == sum(-(-(n + K) // block_size) - -(-n // block_size) for n in forks) > 0
    assert free - runner.num_free_blocks == run.fork_copies + run.growth_blocks
    while not run.done:
        run.step()
    assert runner.num_free_blocks == free - run.fork_copies - run.growth_blocks  # steps take no blocks
    for b in run.finish():
        runner.free_request(b.seq_id)
    assert runner.num_free_blocks == free


def test_sampled_branches_return_their_exact_proposal(model):
    spec = SamplingSpec(temperature=0.9, top_k=40, seed=3)
    runner = make_runner(model, num_blocks=160, block_size=16)
    drafter, roots, ctx = drafted_roots(model, runner, spec)
    depth_k = glue(runner, roots)
    gens = {r.req_id: torch.Generator().manual_seed(i) for i, r in enumerate(roots)}
    calls = []

    def propose(req_id, logits):
        calls.append((req_id, logits.shape[0]))
        n = logits.shape[0]
        return sample_proposals(logits, [spec] * n, [gens[req_id]] * n)

    candidates = [select_candidates(bonus_distributions(drafter.reqs[r.req_id].draft_logits, depth_k[i]),
                                    r.drafts, FANOUT) for i, r in enumerate(roots)]
    branches = draft_branches(runner, roots, candidates, num_steps=3, propose=propose)
    assert calls[: len(roots)] == [(r.req_id, sum(FANOUT)) for r in roots]  # one call per request per step
    assert len(calls) == 3 * len(roots)
    drafts = {r.req_id: list(r.drafts) for r in roots}
    for b in branches:
        assert len(b.tokens) == 3 and b.logits is None and b.probs.shape == (3, model.config.vocab_size)
        prefix = ctx[b.req_id] + drafts[b.req_id][: b.depth] + [b.bonus]
        _, ref_logits = chain(model, prefix, 3, forced=b.tokens)
        ref_q = proposal_probs(ref_logits, spec.temperature, spec.top_k, spec.top_p)
        torch.testing.assert_close(b.probs, ref_q, **TOL)
        assert all(b.probs[s, t] > 0 for s, t in enumerate(b.tokens))
    for b in branches:
        runner.free_request(b.seq_id)
    for r in roots:
        drafter.free(r.req_id)
    assert runner.num_free_blocks == 160


def test_a_run_cut_short_keeps_a_consistent_prefix(model):
    """Two of K steps, then `finish`: each branch has the chain's first two tokens and KV for all but the
    last, so adopting it and feeding that token continues the chain exactly."""
    runner = make_runner(model, num_blocks=64, block_size=16)
    drafter, roots, ctx = drafted_roots(model, runner, SamplingSpec())
    glue(runner, roots)
    run = BranchRun(runner, roots, [[(0, 11), (K, 12), (2, 13)] for _ in roots])
    run.step()
    run.step()
    assert not run.done and run.steps_done == 2
    branches = run.finish()
    for b in branches:
        root = next(r for r in roots if r.req_id == b.req_id)
        prefix = ctx[b.req_id] + list(root.drafts[: b.depth]) + [b.bonus]
        ref_tokens, ref_logits = chain(model, prefix, 3)
        assert b.tokens == ref_tokens[:2] and runner.num_computed(b.seq_id) == len(prefix) + 1
        runner.adopt(b.seq_id, b.req_id)  # (the last adopted per request wins; earlier ones are let go)
        out = runner.forward([(b.req_id, [b.tokens[-1]], len(prefix) + 1)])
        torch.testing.assert_close(out[0], ref_logits[2], **TOL)
        runner.truncate(b.req_id, len(prefix) + 1)
    for r in roots:
        drafter.free(r.req_id)
    assert runner.num_free_blocks == 64


def test_full_cache_drops_the_least_likely_branches(model):
    """Roots of 21 and 37 tokens after the glue hold 2 + 3 blocks; each branch needs one more (its partial
    copy, with room for its 4 tokens): 3 free blocks admit the rank-0 candidates of both requests and the
    rank-1 candidate of the first."""
    runner = make_runner(model, num_blocks=8, block_size=16)
    g = torch.Generator().manual_seed(1)
    roots = []
    for rid, n in [("x", 17), ("y", 33)]:
        runner.add_request(rid)
        runner.forward([(rid, torch.randint(2, 300, (n + K - 1,), generator=g).tolist(), 0)])
        roots.append(BranchRoot(rid, n, (3, 4, 5, 6)))
    glue(runner, roots)
    candidates = [[(0, 10), (1, 11), (2, 12)], [(0, 20), (4, 21)]]
    branches = draft_branches(runner, roots, candidates)
    assert [(b.req_id, b.depth, b.bonus) for b in branches] == [("x", 0, 10), ("x", 1, 11), ("y", 0, 20)]
    assert runner.num_free_blocks == 0 and all(len(b.tokens) == K for b in branches)
    for b in branches:
        runner.free_request(b.seq_id)
    assert runner.num_free_blocks == 3


def test_misuse_is_reported(model):
    runner = make_runner(model, num_blocks=16, block_size=16)
    runner.add_request("x")
    runner.forward([("x", [5, 6, 7, 8], 0)])
    root = BranchRoot("x", 3, (8, 9))  # KV for context + x1: ready for glue
    with pytest.raises(ValueError, match="depth 3 outside"):
        draft_branches(runner, [root], [[(3, 1)]])
    with pytest.raises(ValueError, match="duplicate"):
        draft_branches(runner, [root], [[(0, 1), (0, 1)]])
    with pytest.raises(ValueError, match="depth 2 needs 5 tokens of KV, 4 are computed"):
        draft_branches(runner, [root], [[(0, 1), (2, 1)]])  # depth K before the glue
    assert runner.num_free_blocks == 15  # nothing forked
    glue(runner, [root])
    with pytest.raises(ValueError, match="glue needs"):
        glue(runner, [root])
    assert len(draft_branches(runner, [root], [[(2, 1)]])) == 1


@pytest.mark.parametrize("case", ["greedy", "sampled", "mixed", "short", "tight", "cut", "uneven"])
def test_batched_run_equals_the_per_fork_reference(model, case):
    """`BranchRun` (all forks in one `fork_many`, each step one `forward_batch`, one argmax for greedy
    requests, tokens and logit/prob references as arrays) against `reference_branches` (one fork and
    reserve per candidate, one `forward` of per-branch chunks and one `propose` per request and step) on
    two identical runners: the same branches, tokens, logits and proposal probabilities bit for bit, the
    same blocks for every branch and the same free list; greedy, sampled (a seeded generator per request),
    mixed with `is_greedy`, fewer steps than K, a cache too small for every candidate, a run cut short, and
    roots of different K (later steps advance only some branches)."""
    spec = SamplingSpec(temperature=0.8, top_k=50, seed=5)
    num_blocks = {"tight": 36}.get(case, 160)
    runs = []
    for _ in range(2):
        runner = make_runner(model, num_blocks=num_blocks, block_size=16)
        drafter, roots, _ = drafted_roots(model, runner, SamplingSpec())
        depth_k = glue(runner, roots)
        candidates = [select_candidates(bonus_distributions(drafter.reqs[r.req_id].draft_logits, depth_k[i]),
                                        r.drafts, FANOUT) for i, r in enumerate(roots)]
        if case == "uneven":  # every other root sent only 2 drafts: its branches draft 2 tokens, the others K
            roots = [BranchRoot(r.req_id, r.context_len, r.drafts[:2]) if i % 2 else r for i, r in enumerate(roots)]
            candidates = [[c for c in cands if c[0] <= r.k] for r, cands in zip(roots, candidates, strict=True)]
        gens = {r.req_id: torch.Generator().manual_seed(i) for i, r in enumerate(roots)}
        sampled = {r.req_id for i, r in enumerate(roots)
                   if case in ("sampled", "tight") or (case in ("mixed", "uneven") and i % 2 == (case == "mixed"))}

        def propose(req_id, logits, gens=gens, sampled=sampled):
            if req_id not in sampled:
                return logits.argmax(dim=-1), None
            return sample_proposals(logits, [spec] * logits.shape[0], [gens[req_id]] * logits.shape[0])

        runs.append((runner, roots, candidates, propose, sampled))
    steps = 2 if case == "short" else None
    runner, roots, candidates, propose, sampled = runs[0]
    ref, ref_logits, ref_probs = reference_branches(runner, roots, candidates, num_steps=steps, propose=propose,
                                                    max_steps=2 if case == "cut" else None)
    runner2, roots2, candidates2, propose2, sampled2 = runs[1]
    assert candidates2 == candidates
    run = BranchRun(runner2, roots2, candidates2, num_steps=steps, propose=propose2, keep_logits=True,
                    is_greedy=lambda req_id: req_id not in sampled2)
    for _ in range(2 if case == "cut" else 99):
        if run.done:
            break
        run.step()
    got = run.finish()
    def keys(branches):
        return [(b.req_id, b.depth, b.bonus, b.seq_id) for b in branches]

    assert keys(got) == keys(ref)
    if case == "tight":
        assert run.dropped > 0
    for b, r, lg, pr in zip(got, ref, ref_logits, ref_probs, strict=True):
        k = next(root.k for root in roots if root.req_id == b.req_id)
        assert b.tokens == r.tokens and len(b.tokens) == (2 if case in ("short", "cut") else k)
        assert torch.equal(b.logits, torch.stack(lg))
        if pr:
            assert torch.equal(b.probs, torch.stack(pr))
        else:
            assert b.probs is None
        assert runner2._get(b.seq_id).block_table.blocks == runner._get(r.seq_id).block_table.blocks
        assert runner2.num_computed(b.seq_id) == runner.num_computed(r.seq_id)
    assert runner2.kv_cache.allocator._free == runner.kv_cache.allocator._free
    assert runner2.kv_cache.allocator._refs == runner.kv_cache.allocator._refs
    # every sequence's written KV (slots past a sequence's length are never read: a fork given back after
    # its partial-block copy left that copy in a block the reference hands out again as growth)
    for seq_id, req in runner._requests.items():
        slots = torch.tensor(req.block_table.slots(0, req.num_computed))
        assert runner2._get(seq_id).block_table.slots(0, req.num_computed) == slots.tolist()
        for a, c in zip(runner.kv_cache.layers, runner2.kv_cache.layers, strict=True):
            assert torch.equal(a.flatten(1, 2)[:, slots], c.flatten(1, 2)[:, slots])
