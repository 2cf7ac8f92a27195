"""SSD's multi-branch draft step (ssd-algorithm.md §3-4), run on forked runner sequences.

A request that has just sent drafts x1..xK for verification holds KV for its committed context (L tokens,
the last being the pending bonus token) and x1..x_{K-1}, as `SyncDrafter` leaves it. Every candidate
outcome "j drafts accepted, bonus token t" becomes one branch: a fork of the request's sequence at L + j
tokens, fed t and then its own drafts. One runner forward per step (`forward_batch`) advances all branches of
all requests, so K steps draft K tokens for every branch.

Each branch is a fork of its request (shared prefix blocks, private tail; a row of the round's `ForkGroup`,
a runner sequence id all the same), attended like any chain (the runner's one-token-per-sequence forward,
through the compiled `decode_attention` op where it is active): its drafts equal those of the same tokens run
alone from scratch, by construction and by test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat

import numpy as np
import torch

from saguaro_vllm.drafter.runner import DraftModelRunner, ForkGroup

#: (request id, logits [n, vocab] of that request's branches at one step) -> (tokens [n], proposal probs
#: [n, vocab] or None). Called once per request per step, branches in candidate order.
Propose = Callable[[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def greedy(req_id: str, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The greedy proposal: argmax, no probabilities (verified one-hot)."""
    return logits.argmax(dim=-1), None


@dataclass(frozen=True)
class BranchRoot:
    """A request whose drafts are out for verification: its runner sequence holds `context_len` +
    `len(drafts) - 1` tokens of KV (`glue` adds the last draft's)."""

    req_id: str
    context_len: int  # L: committed tokens, the last one the pending bonus token
    drafts: tuple[int, ...]  # x1..xK as sent

    @property
    def k(self) -> int:
        return len(self.drafts)


@dataclass(slots=True)
class Branch:
    """One pre-drafted outcome: `depth` drafts accepted, then `bonus`; `tokens` y1..y_steps drafted after.

    `seq_id` is the runner sequence holding KV for context + x1..x_depth + bonus + y1..y_{steps-1}: the
    state `SyncDrafter` would be in after drafting `tokens` from that context (adopt it on a hit).
    """

    req_id: str
    depth: int
    bonus: int
    seq_id: str
    tokens: list[int]
    #: the run's per-step records and this branch's index in them (`logit_refs`, `prob_refs`)
    _steps: list[_Step] | None = field(default=None, repr=False, compare=False)
    _index: int = field(default=0, repr=False, compare=False)

    @property
    def logit_refs(self) -> list[tuple[torch.Tensor, int]]:
        """Per step, with keep_logits: where its fp32 logits [vocab] are (next round's depth distributions),
        as (the step's tensor, row) pairs. Built only when read (only the hit's are ever used: a view per
        branch and step cost ~80 us of host time each, 0.16 s per step at batch 64 x 32 branches, and even a
        pair per branch and step is 10k a round there)."""
        steps = self._steps[: len(self.tokens)] if self._steps else []
        return [(st.logits, st.row(self._index)) for st in steps if st.logits is not None]

    @property
    def prob_refs(self) -> list[tuple[torch.Tensor, int]]:
        """Per step, for sampled proposals: (the step's proposal probabilities, row) of this branch."""
        refs = []
        for st in self._steps[: len(self.tokens)] if self._steps else []:
            ref = st.prob_ref(self._index)
            if ref is not None:
                refs.append(ref)
        return refs

    @property
    def logit_rows(self) -> list[torch.Tensor]:
        return [t[r] for t, r in self.logit_refs]

    @property
    def prob_rows(self) -> list[torch.Tensor]:
        return [t[r] for t, r in self.prob_refs]

    @property
    def logits(self) -> torch.Tensor | None:
        """`[steps, vocab]` fp32 logits, or None without keep_logits."""
        return torch.stack(self.logit_rows) if self.logit_rows else None

    @property
    def probs(self) -> torch.Tensor | None:
        """`[steps, vocab]` proposal probabilities, or None for greedy proposals."""
        return torch.stack(self.prob_rows) if self.prob_rows else None


@dataclass
class _Step:
    """What one `BranchRun.step` leaves for its branches: the logits (with keep_logits), which row of them
    is whose, and the sampled requests' proposal probabilities."""

    logits: torch.Tensor | None
    where: np.ndarray | None  # branch index -> row of this step (None: every branch, in order)
    probs: list[tuple[torch.Tensor, int]]  # per sampled request: (its probabilities, its first row)
    prob_of: np.ndarray | None  # branch index -> index into `probs`, or -1

    def row(self, index: int) -> int:
        return index if self.where is None else int(self.where[index])

    def prob_ref(self, index: int) -> tuple[torch.Tensor, int] | None:
        if self.prob_of is None or self.prob_of[index] < 0:
            return None
        probs, start = self.probs[self.prob_of[index]]
        return probs, self.row(index) - start


def branch_seq_id(req_id: str, depth: int, bonus: int) -> str:
    """Runner sequence id of a branch (unique per request and outcome; the runner refuses duplicates)."""
    return f"{req_id}\x00branch:{depth}:{bonus}"


def _check(runner: DraftModelRunner, roots: Sequence[BranchRoot], candidates: Sequence[Sequence[tuple[int, int]]]
           ) -> None:
    """The candidates' checks, request by request (the error of the first request at fault)."""
    for root, cands in zip(roots, candidates, strict=True):
        if len(set(cands)) != len(cands):
            raise ValueError(f"request {root.req_id!r}: duplicate candidates")
        computed = runner.num_computed(root.req_id)
        for j, _ in cands:
            if not 0 <= j <= root.k:
                raise ValueError(f"request {root.req_id!r}: depth {j} outside 0..{root.k}")
            if root.context_len + j > computed:
                raise ValueError(f"request {root.req_id!r}: depth {j} needs {root.context_len + j} tokens of "
                                 f"KV, {computed} are computed (depth K needs the glue first)")


def _admit(
    runner: DraftModelRunner, roots: Sequence[BranchRoot], candidates: Sequence[Sequence[tuple[int, int]]],
    steps: list[int],
) -> tuple[ForkGroup, np.ndarray, np.ndarray, np.ndarray]:
    """Fork and reserve every branch that fits, rank by rank across requests (the first candidate of every
    request before anyone's second), so a full cache drops the least likely outcomes first: one
    `runner.fork_group`, its rows in that priority order. Returns the group and per row its root, depth and
    bonus."""
    lens = np.array([len(c) for c in candidates], dtype=np.int64)
    pairs = np.fromiter(chain.from_iterable(chain.from_iterable(candidates)), dtype=np.int64,
                        count=2 * int(lens.sum())).reshape(-1, 2)
    root_of = np.repeat(np.arange(len(roots)), lens)
    depth, bonus = pairs[:, 0], pairs[:, 1]
    k = np.array([r.k for r in roots], dtype=np.int64)
    base = np.array([r.context_len for r in roots], dtype=np.int64)
    computed = np.array([runner.num_computed(r.req_id) for r in roots], dtype=np.int64)
    key = (root_of << 40) + (depth << 32) + bonus  # equal for equal candidates (distinct for the valid)
    if len(np.unique(key)) < len(key) or (depth < 0).any() or (depth > k[root_of]).any() \
            or (base[root_of] + depth > computed[root_of]).any():
        _check(runner, roots, candidates)  # all checks first (each error as the request's own): no fork to undo
    rank = np.arange(len(root_of)) - np.repeat(np.cumsum(lens) - lens, lens)
    keep = np.flatnonzero(np.array(steps, dtype=np.int64)[root_of] >= 1)
    order = keep[np.argsort(rank[keep], kind="stable")]  # rank by rank, requests in order within a rank
    root_of, depth, bonus = root_of[order], depth[order], bonus[order]
    req_ids = [r.req_id for r in roots]
    # `branch_seq_id` of each, inlined (2048 calls at batch 64 x 32)
    ids = [f"{req_ids[r]}\x00branch:{d}:{b}" for r, d, b in zip(root_of.tolist(), depth.tolist(), bonus.tolist())]
    group = runner.fork_group(req_ids, ids, root_of, base[root_of] + depth, np.array(steps, dtype=np.int64)[root_of])
    rows = group.admitted
    return group, root_of[rows], depth[rows], bonus[rows]


class BranchRun:
    """The branches of one round, advanced one batched step at a time, so that a drafter loop can look for
    an arriving outcome between steps and stop early (`finish` then returns the tokens drafted so far; a
    branch with s tokens has KV for its first s-1, the same invariant as after all steps).

    `candidates[r]` lists root r's outcomes `(depth, bonus)` in priority order; depth K needs `glue`
    first. Branches that do not fit in the KV cache are left out (see `_admit`). `num_steps` defaults to
    each root's K; `propose` chooses the tokens (greedy by default); `keep_logits` keeps each step's
    logits (the next round's bonus distributions if the branch hits). `is_greedy(req_id)`: requests whose
    proposal is the argmax (`greedy`): their rows take one batched argmax instead of `propose`.

    The branches' runner state, their next tokens and the tokens drafted are arrays (a `ForkGroup`, numpy):
    neither admission nor a step has Python per branch beyond its id and its `Branch`; `finish` hands the
    tokens to the branches.
    """

    def __init__(
        self,
        runner: DraftModelRunner,
        roots: Sequence[BranchRoot],
        candidates: Sequence[Sequence[tuple[int, int]]],
        num_steps: int | None = None,
        propose: Propose = greedy,
        keep_logits: bool = False,
        vocab_size: int | None = None,
        is_greedy: Callable[[str], bool] | None = None,
    ):
        if len(candidates) != len(roots):
            raise ValueError(f"{len(roots)} roots but {len(candidates)} candidate lists")
        if len({r.req_id for r in roots}) != len(roots):
            raise ValueError("a request appears twice among the roots")
        self.runner, self.propose, self.keep_logits, self.vocab_size = runner, propose, keep_logits, vocab_size
        steps = [num_steps if num_steps is not None else r.k for r in roots]
        group, root_of, depth, bonus = _admit(runner, roots, candidates, steps)
        #: KV blocks copied by forks inside a block, and reserved for the branches' tokens past a block edge
        #: (all of a round's blocks are taken here, none by `step`)
        self.fork_copies, self.growth_blocks = int(group.copied.sum()), int(group.grown.sum())
        # branches grouped by root, in candidate order (each request's rows contiguous for `propose`); the
        # group's rows are in admission (priority) order: `_rows` maps a branch to its row
        self._rows = np.argsort(root_of, kind="stable")
        self._group = group
        self._owner = root_of[self._rows]  # root of each branch
        #: candidates left out because the KV cache had no room for them
        self.dropped = sum(len(c) for c in candidates) - len(group)
        self._req_ids = [r.req_id for r in roots]
        self._want = np.array(steps, dtype=np.int64)[self._owner]  # steps each branch wants
        all_greedy = propose is greedy
        self._greedy = np.array([all_greedy or (is_greedy is not None and is_greedy(r.req_id)) for r in roots],
                                dtype=bool)
        self._next = bonus[self._rows]  # each branch's next input
        self._tokens = np.zeros((len(group), max(steps, default=0)), dtype=np.int64)
        self._steps: list[_Step] = []
        n = len(group)  # the branches (here, not in `finish`: that may be on an answer's path), in C loops
        self._branches = list(map(Branch, map(self._req_ids.__getitem__, self._owner.tolist()),
                                  depth[self._rows].tolist(), self._next.tolist(),
                                  map(group.ids.__getitem__, self._rows.tolist()), [[] for _ in range(n)],
                                  repeat(self._steps, n), range(n)))
        self.steps_done = 0

    @property
    def live_rows(self) -> int:
        """Branches the next `step` advances."""
        return int(np.count_nonzero(self._want > self.steps_done))

    @property
    def done(self) -> bool:
        return not (self._want > self.steps_done).any()

    @torch.inference_mode()
    def step(self) -> None:
        """One runner forward (`forward_batch`) over every branch that wants more tokens."""
        s = self.steps_done
        wanted = self._want > s
        self.steps_done += 1
        n = int(np.count_nonzero(wanted))
        if not n:
            return
        live = None if n == len(wanted) else np.flatnonzero(wanted)
        rows = slice(None) if live is None else live
        logits = self.runner.forward_batch(self._group, self._next[rows], self._rows[rows])
        if self.vocab_size:
            logits = logits[:, : self.vocab_size]
        owner = self._owner[rows]
        probs: list[tuple[torch.Tensor, int]] = []
        prob_of = None
        chosen = None
        if self._greedy[owner].all():  # row by row the same as one argmax per request
            if logits.device.type == "cpu":  # numpy's: the same token (first maximum), a tenth of torch's time
                tokens = logits.numpy().argmax(axis=1)  # on a CPU core (0.04 vs 0.4 ms at 2048 x 256)
            else:
                chosen = logits.argmax(dim=-1)
        else:  # one call per request: its branches are contiguous
            ends = np.flatnonzero(owner[1:] != owner[:-1]) + 1
            parts = []
            for start, end in zip([0, *ends.tolist()], [*ends.tolist(), n], strict=True):
                r = int(owner[start])
                if self._greedy[r]:
                    parts.append(logits[start:end].argmax(dim=-1))
                    continue
                tokens, p = self.propose(self._req_ids[r], logits[start:end])
                parts.append(tokens.reshape(-1))
                if p is not None:
                    if prob_of is None:
                        prob_of = np.full(len(self._want), -1, dtype=np.int64)
                    prob_of[(np.arange(start, end) if live is None else live[start:end])] = len(probs)
                    probs.append((p, start))
            chosen = torch.cat(parts)
        if chosen is not None:  # every branch's token in one device-to-host transfer (not one per branch)
            tokens = np.array(chosen.tolist(), dtype=np.int64)
        self._next[rows] = tokens
        self._tokens[rows, s] = tokens
        where = None
        if live is not None:
            where = np.full(len(self._want), -1, dtype=np.int64)
            where[live] = np.arange(n)
        self._steps.append(_Step(logits if self.keep_logits else None, where, probs, prob_of))

    def finish(self) -> list[Branch]:
        """The branches (grouped by root, in candidate order), each owning its runner sequence: free it, or
        `runner.adopt` it on a hit. Branches cut short before their first step have no tokens."""
        done = min(self.steps_done, self._tokens.shape[1])
        rows = self._tokens[:, :done].tolist()
        if (self._want >= done).all():  # every branch drafted `done` tokens
            for b, tokens in zip(self._branches, rows, strict=True):
                b.tokens = tokens
        else:
            for b, tokens, count in zip(self._branches, rows, np.minimum(self._want, done).tolist(), strict=True):
                b.tokens = tokens[:count]
        return list(self._branches)
