"""The speculation cache: outcome keys derived from the committed tokens, hits and misses counted overall
and per depth, per-request invalidation, stale branches refused, every non-hit branch released; and the whole
round trip on a real runner (glue, branches, lookup, adopt) without leaked blocks."""

from __future__ import annotations

import doctest

import pytest
import torch
from branch_runs import draft_branches, glue

import saguaro_vllm.drafter.spec_cache as spec_cache_module
from saguaro_vllm.drafter.branches import Branch, BranchRoot
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.spec_cache import Outcome, SpeculationCache, derive_outcome

DRAFTS = (5, 6, 7)


def test_doctests():
    assert doctest.testmod(spec_cache_module).failed == 0


@pytest.mark.parametrize(("new", "expected"), [
    ([9], Outcome(0, 9)),
    ([5, 9], Outcome(1, 9)),
    ([5, 6, 9], Outcome(2, 9)),
    ([5, 6, 7, 8], Outcome(3, 8)),
    ([5, 6, 7, 7], Outcome(3, 7)),
    ([], None),  # nothing committed
    ([5, 6], None),  # drafts only, no bonus (drafts trimmed before verification)
    ([5, 9, 4], None),  # two tokens past the accepted prefix: skipped steps
    ([5, 6, 7, 8, 1], None),
])
def test_derive_outcome(new, expected):
    assert derive_outcome(DRAFTS, new) == expected


def branch(req_id: str, depth: int, bonus: int) -> Branch:
    return Branch(req_id, depth, bonus, f"{req_id}/{depth}/{bonus}", [1, 2, 3])


def filled(released: list[str]) -> tuple[SpeculationCache, int]:
    cache = SpeculationCache(released.append)
    rnd = cache.start_round("r", 10, DRAFTS)
    for key in [(0, 9), (0, 8), (1, 9), (3, 4)]:
        assert cache.put(branch("r", *key), rnd)
    return cache, rnd


def test_hit_returns_the_branch_and_releases_the_others():
    released: list[str] = []
    cache, _ = filled(released)
    assert sorted(cache.outcomes("r")) == [(0, 8), (0, 9), (1, 9), (3, 4)] and len(cache) == 4
    assert cache.has_entries("r") and not cache.has_entries("q")
    outcome, hit = cache.lookup("r", 10, [5, 9])
    assert outcome == Outcome(1, 9) and (hit.depth, hit.bonus) == (1, 9)
    assert sorted(released) == ["r/0/8", "r/0/9", "r/3/4"] and len(cache) == 0
    s = cache.stats
    assert (s.lookups, s.hits, s.unmatched, s.hit_rate) == (1, 1, 0, 1.0)
    assert s.lookups_by_depth == {1: 1} and s.hits_by_depth == {1: 1}
    assert cache.lookup("r", 12, [1]) == (None, None)  # the round is over: a second lookup is a miss
    assert not cache.has_entries("r")


def test_miss_counts_its_depth_and_releases_everything():
    released: list[str] = []
    cache, _ = filled(released)
    assert cache.lookup("r", 10, [5, 6, 7, 5]) == (Outcome(3, 5), None)  # (3, 5) was not predicted
    assert len(released) == 4 and len(cache) == 0
    s = cache.stats
    assert (s.lookups, s.hits, s.unmatched) == (1, 0, 0)
    assert s.lookups_by_depth == {3: 1} and s.hits_by_depth == {}


@pytest.mark.parametrize(("start", "new"), [(11, [5, 9]), (10, [5, 9, 1]), (10, [])])
def test_unmatched_lookups_are_misses(start, new):
    released: list[str] = []
    cache, _ = filled(released)
    assert cache.lookup("r", start, new) == (None, None)
    assert len(released) == 4 and cache.stats.unmatched == 1 and cache.stats.lookups_by_depth == {}
    assert cache.lookup("never-seen", 0, [1]) == (None, None) and cache.stats.unmatched == 2


def test_new_round_invalidates_and_stale_branches_are_refused():
    released: list[str] = []
    cache, old = filled(released)
    cache.put(branch("other", 0, 1), cache.start_round("other", 3, (1,)))
    new = cache.start_round("r", 14, (1, 2, 3))
    assert len(released) == 4 and cache.outcomes("r") == [] and cache.outcomes("other") == [(0, 1)]
    assert not cache.put(branch("r", 0, 5), old)  # pre-drafted for the old round: released, not served
    assert released[-1] == "r/0/5"
    assert cache.put(branch("r", 0, 5), new)
    with pytest.raises(ValueError, match="already cached"):
        cache.put(branch("r", 0, 5), new)
    cache.drop("r")
    assert not cache.put(branch("r", 1, 5), new)  # finished request
    cache.clear()
    assert len(cache) == 0 and released[4:] == ["r/0/5", "r/0/5", "r/1/5", "other/0/1"]


def test_round_trip_on_the_runner(tiny_pair):
    """glue -> branches -> cache -> lookup -> adopt: the hit's KV becomes the request's, nothing leaks."""
    model = load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=32, block_size=16))
    cache = SpeculationCache(runner.free_request)
    context, drafts = list(range(2, 22)), (30, 31, 32)
    runner.add_request("r")
    runner.forward([("r", context + list(drafts[:-1]), 0)])
    root = BranchRoot("r", len(context), drafts)
    rnd = cache.start_round("r", len(context), drafts)
    glue(runner, [root])
    for b in draft_branches(runner, [root], [[(0, 40), (1, 41), (2, 42), (3, 43)]]):
        cache.put(b, rnd)
    _, hit = cache.lookup("r", len(context), [30, 41])
    assert hit is not None and (hit.depth, hit.bonus) == (1, 41)
    runner.adopt(hit.seq_id, "r")
    assert runner.num_computed("r") == len(context) + 2 + 2  # context, x1, t, y1, y2 (y3 has no KV yet)
    alloc = runner.kv_cache.allocator
    assert alloc.num_free == 32 - 2  # the adopted sequence only
    runner.free_request("r")
    assert alloc.num_free == 32


def test_release_many_gets_a_rounds_branches_in_release_order():
    """With `release_many`, a lookup, a drop and a new round hand over their branches in one call each, in the
    order `release` alone would have seen them; a stale `put` still goes through `release`."""
    def run(cache):
        rnd = cache.start_round("r", 10, DRAFTS)
        for key in [(0, 9), (0, 8), (1, 9), (3, 4)]:
            cache.put(branch("r", *key), rnd)
        cache.lookup("r", 10, [5, 9])  # hit (1, 9): the other three go
        rnd = cache.start_round("r", 12, DRAFTS)
        for key in [(2, 1), (0, 3)]:
            cache.put(branch("r", *key), rnd)
        cache.start_round("r", 14, DRAFTS)  # a new round drops these two
        cache.put(branch("r", 4, 4), rnd)  # stale
        rnd = cache.start_round("q", 3, DRAFTS)
        cache.put(branch("q", 0, 1), rnd)
        cache.drop("q")

    one: list[str] = []
    run(SpeculationCache(one.append))
    calls: list[list[str]] = []
    single: list[str] = []
    run(SpeculationCache(single.append, release_many=lambda branches: calls.append([b.seq_id for b in branches])))
    assert calls == [["r/0/9", "r/0/8", "r/3/4"], ["r/2/1", "r/0/3"], ["q/0/1"]] and single == ["r/4/4"]
    assert [s for c in calls[:2] for s in c] + single + calls[2] == one


def test_put_many_equals_put_of_each():
    """`put_many` (a request's branches at once, what the pre-draft does) leaves the entries `put` of each
    leaves, refuses an outcome twice and a branch of another request (changing nothing), and hands a stale
    round's branches to `release_many` (or `release` of each without it)."""
    keys = [(0, 9), (0, 8), (1, 9), (3, 4)]
    one, many = SpeculationCache([].append), SpeculationCache([].append)
    rnd = [one.start_round("r", 10, DRAFTS), many.start_round("r", 10, DRAFTS)]
    for key in keys:
        one.put(branch("r", *key), rnd[0])
    assert many.put_many("r", [branch("r", *key) for key in keys], rnd[1])
    assert many.outcomes("r") == one.outcomes("r") and len(many) == 4
    with pytest.raises(ValueError, match="cached twice"):
        many.put_many("r", [branch("r", 2, 1), branch("r", 0, 8)], rnd[1])
    with pytest.raises(ValueError, match="cached twice"):
        many.put_many("r", [branch("r", 2, 1), branch("r", 2, 1)], rnd[1])
    with pytest.raises(ValueError, match="another request"):
        many.put_many("r", [branch("q", 2, 1)], rnd[1])
    assert many.outcomes("r") == one.outcomes("r")
    assert many.lookup("r", 10, [5, 9])[1].seq_id == "r/1/9"
    released: list[str] = []
    calls: list[list[str]] = []
    for cache in (SpeculationCache(released.append),
                  SpeculationCache(released.append, release_many=lambda bs: calls.append([b.seq_id for b in bs]))):
        old = cache.start_round("r", 10, DRAFTS)
        cache.start_round("r", 12, DRAFTS)
        assert not cache.put_many("r", [branch("r", 0, 1), branch("r", 1, 2)], old)
    assert released == ["r/0/1", "r/1/2"] and calls == [["r/0/1", "r/1/2"]]
