"""The speculation cache: pre-drafted continuations keyed by the verification outcome they assume.

Per request, one round at a time: `start_round` records the drafts sent for verification (and lets go of
whatever the previous round left), the pre-drafting loop `put`s one branch per candidate outcome, and
`lookup` turns the committed tokens that came back into an outcome `(a, t)` and answers with that branch
or nothing (and the outcome, for the acceptance estimate). Branches own runner sequences; the cache hands each one either to the caller (the hit) or to
`release` (everything else), so no KV outlives its round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from saguaro_vllm.drafter.branches import Branch


@dataclass(frozen=True)
class Outcome:
    accepted: int  # a: leading drafts the target accepted
    bonus: int  # t: the token the target added after them


def derive_outcome(drafts: Sequence[int], new_tokens: Sequence[int]) -> Outcome | None:
    """The outcome that the committed tokens appended in one round imply, or None when they are not exactly
    "a drafts, then one token" (no token at all, or more than one past the accepted prefix: skipped steps,
    a resync). None is always safe: it is a miss.

    >>> derive_outcome([5, 6, 7], [5, 9])
    Outcome(accepted=1, bonus=9)
    >>> derive_outcome([5, 6, 7], [5, 6, 7, 8])
    Outcome(accepted=3, bonus=8)
    >>> derive_outcome([5, 6, 7], [5, 9, 4]) is None, derive_outcome([5, 6, 7], [5, 6]) is None
    (True, True)
    """
    a, n = 0, min(len(drafts), len(new_tokens))
    while a < n and drafts[a] == new_tokens[a]:
        a += 1
    if len(new_tokens) != a + 1:
        return None
    return Outcome(a, int(new_tokens[a]))


@dataclass
class CacheStats:
    """Lookup counters; `*_by_depth` count lookups whose outcome was derivable, by its accepted count a."""

    lookups: int = 0
    hits: int = 0
    unmatched: int = 0  # lookups with no round, a stale position, or tokens that are not one outcome
    lookups_by_depth: dict[int, int] = field(default_factory=dict)
    hits_by_depth: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class _Round:
    round_id: int
    context_len: int  # L: where the new committed tokens of the outcome must start
    drafts: tuple[int, ...]
    entries: dict[tuple[int, int], Branch] = field(default_factory=dict)


class SpeculationCache:
    def __init__(self, release: Callable[[str], None],
                 release_many: Callable[[list[Branch]], None] | None = None):
        """`release(seq_id)` frees a branch's runner sequence (normally `runner.free_request`);
        `release_many(branches)`, where given, the branches of a round at once, in order (a lookup at batch 64
        with 32 branches per request lets go of ~2000: one call per branch was a third of the answer). It gets
        the branches, not their ids: reading 31 ids per looked-up row cost ~3 us of the answer, and a caller
        that frees later (the SSD drafter, once the answer is out) reads them then."""
        self._release = release
        self._release_many = release_many
        self._rounds: dict[str, _Round] = {}
        self._next_round = 0
        self.stats = CacheStats()

    def start_round(self, req_id: str, context_len: int, drafts: Sequence[int]) -> int:
        """Drafts `drafts` were sent for verification after `context_len` committed tokens; invalidates the
        request's previous round. Returns the round id that `put` must quote."""
        self.drop(req_id)
        self._next_round += 1
        self._rounds[req_id] = _Round(self._next_round, context_len, tuple(drafts))
        return self._next_round

    def put(self, branch: Branch, round_id: int) -> bool:
        """Store a branch pre-drafted for `round_id`. A branch of a round that is over (the outcome came
        first, or the request finished) is released at once and False returned: never served stale."""
        rnd = self._rounds.get(branch.req_id)
        if rnd is None or rnd.round_id != round_id:
            self._release(branch.seq_id)
            return False
        key = (branch.depth, branch.bonus)
        if key in rnd.entries:
            raise ValueError(f"request {branch.req_id!r}: outcome {key} is already cached")
        rnd.entries[key] = branch
        return True

    def put_many(self, req_id: str, branches: list[Branch], round_id: int) -> bool:
        """`put` of each of a request's branches (all of `req_id`), the round's entries made in one dict built
        in C (a pre-draft at batch 64 x 32 branches puts 2048). Stale: every one released, False."""
        rnd = self._rounds.get(req_id)
        if rnd is None or rnd.round_id != round_id:
            if self._release_many is not None:
                self._release_many(list(branches))
            else:
                for branch in branches:
                    self._release(branch.seq_id)
            return False
        entries = dict(zip(zip(map(attrgetter("depth"), branches), map(attrgetter("bonus"), branches)), branches))
        if len(entries) != len(branches) or not rnd.entries.keys().isdisjoint(entries):
            raise ValueError(f"request {req_id!r}: an outcome is cached twice")
        if next((b for b in branches if b.req_id != req_id), None) is not None:
            raise ValueError(f"a branch of another request among those of {req_id!r}")
        rnd.entries.update(entries)
        return True

    def lookup(self, req_id: str, start: int, new_tokens: Sequence[int]) -> tuple[Outcome | None, Branch | None]:
        """The outcome the committed tokens `new_tokens` (the first at position `start`) imply (None when
        unmatched: feed nothing to the acceptance estimate) and the branch cached for it (None: a miss).

        Ends the request's round either way: the hit branch goes to the caller (who owns its sequence
        from then on, e.g. `runner.adopt(branch.seq_id, req_id)`), every other branch is released.
        """
        self.stats.lookups += 1
        rnd = self._rounds.pop(req_id, None)
        outcome = None
        if rnd is not None and start == rnd.context_len:
            outcome = derive_outcome(rnd.drafts, new_tokens)
        if outcome is None:
            self.stats.unmatched += 1
            self._release_all(rnd)
            return None, None
        a = outcome.accepted
        self.stats.lookups_by_depth[a] = self.stats.lookups_by_depth.get(a, 0) + 1
        hit = rnd.entries.pop((a, outcome.bonus), None)
        self._release_all(rnd)
        if hit is not None:
            self.stats.hits += 1
            self.stats.hits_by_depth[a] = self.stats.hits_by_depth.get(a, 0) + 1
        return outcome, hit

    def drop(self, req_id: str) -> None:
        """Forget the request's round and release its branches (new round, finished or preempted)."""
        self._release_all(self._rounds.pop(req_id, None))

    def clear(self) -> None:
        for req_id in list(self._rounds):
            self.drop(req_id)

    def has_entries(self, req_id: str) -> bool:
        """Whether the request's current round holds any branch (`bool(outcomes(...))` without the list)."""
        rnd = self._rounds.get(req_id)
        return rnd is not None and bool(rnd.entries)

    def outcomes(self, req_id: str) -> list[tuple[int, int]]:
        """The cached (accepted, bonus) keys of the request's current round."""
        rnd = self._rounds.get(req_id)
        return list(rnd.entries) if rnd else []

    def __len__(self) -> int:
        """Cached branches over all requests."""
        return sum(len(r.entries) for r in self._rounds.values())

    def _release_all(self, rnd: _Round | None) -> None:
        if rnd is not None and rnd.entries:
            if self._release_many is not None:
                self._release_many(list(rnd.entries.values()))
            else:
                for branch in rnd.entries.values():
                    self._release(branch.seq_id)
            rnd.entries.clear()
