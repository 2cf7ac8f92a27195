"""SSD's multi-branch draft step (ssd-algorithm.md §3-4), run on forked runner sequences.

A request that has just sent drafts x1..xK for verification holds KV for its committed context (L tokens,
the last being the pending bonus token) and x1..x_{K-1}, as `SyncDrafter` leaves it. Every candidate
outcome "j drafts accepted, bonus token t" becomes one branch: a fork of the request's sequence at L + j
tokens, fed t and then its own drafts. One `runner.forward` per step advances all branches of all requests,
so K steps draft K tokens for every branch.

Each branch is an ordinary sequence (shared prefix blocks, private tail), attended like any chain (the
runner's one-token-per-sequence forward, through the compiled `decode_attention` op where it is active):
its drafts equal those of the same tokens run alone from scratch, by construction and by test.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from saguaro_vllm.drafter.kv_cache import OutOfBlocksError
from saguaro_vllm.drafter.runner import DraftModelRunner

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


@dataclass
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
    #: per step, with keep_logits: where its fp32 logits [vocab] are (next round's depth distributions)
    #: and, for sampled proposals, its proposal probabilities: (the step's tensor, row) pairs, made into
    #: views only when read (only the hit's are ever used; a view per branch and step cost ~80 us of host
    #: time each, 0.16 s per step at batch 64 x 32 branches)
    logit_refs: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    prob_refs: list[tuple[torch.Tensor, int]] = field(default_factory=list)

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


def branch_seq_id(req_id: str, depth: int, bonus: int) -> str:
    """Runner sequence id of a branch (unique per request and outcome; the runner refuses duplicates)."""
    return f"{req_id}\x00branch:{depth}:{bonus}"


def _admit(
    runner: DraftModelRunner, roots: Sequence[BranchRoot], candidates: Sequence[Sequence[tuple[int, int]]],
    steps: list[int],
) -> tuple[list[list[Branch]], int, int]:
    """Fork and reserve every branch that fits, rank by rank across requests (the first candidate of every
    request before anyone's second), so a full cache drops the least likely outcomes first. Also returns the
    KV blocks the forks copied (a fork point inside a block) and those reserved for growth past block edges."""
    for root, cands in zip(roots, candidates, strict=True):  # all checks first: no fork to undo
        if len(set(cands)) != len(cands):
            raise ValueError(f"request {root.req_id!r}: duplicate candidates")
        computed = runner.num_computed(root.req_id)
        for j, _ in cands:
            if not 0 <= j <= root.k:
                raise ValueError(f"request {root.req_id!r}: depth {j} outside 0..{root.k}")
            if root.context_len + j > computed:
                raise ValueError(f"request {root.req_id!r}: depth {j} needs {root.context_len + j} tokens of "
                                 f"KV, {computed} are computed (depth K needs the glue first)")
    admitted: list[list[Branch]] = [[] for _ in roots]
    counts = [0, 0]  # KV blocks copied by forks, reserved for growth
    with runner.kv_cache.deferred_copies():  # every fork's partial-block copy in one indexed copy per layer
        _admit_ranks(runner, roots, candidates, steps, admitted, counts)
    return admitted, counts[0], counts[1]


def _admit_ranks(runner: DraftModelRunner, roots, candidates, steps: list[int], admitted: list[list[Branch]],
                 counts: list[int]) -> None:
    for rank in range(max((len(c) for c in candidates), default=0)):
        for r, root in enumerate(roots):
            if rank >= len(candidates[r]) or steps[r] < 1:
                continue
            depth, bonus = candidates[r][rank]
            seq_id = branch_seq_id(root.req_id, depth, bonus)
            free = runner.num_free_blocks
            try:
                runner.fork(root.req_id, seq_id, root.context_len + depth)
            except OutOfBlocksError:
                continue
            forked = runner.num_free_blocks
            try:
                runner.reserve(seq_id, steps[r])
            except OutOfBlocksError:
                runner.free_request(seq_id)
                continue
            counts[0] += free - forked
            counts[1] += forked - runner.num_free_blocks
            admitted[r].append(Branch(root.req_id, depth, bonus, seq_id, []))


class BranchRun:
    """The branches of one round, advanced one batched step at a time, so that a drafter loop can look for
    an arriving outcome between steps and stop early (`finish` then returns the tokens drafted so far; a
    branch with s tokens has KV for its first s-1, the same invariant as after all steps).

    `candidates[r]` lists root r's outcomes `(depth, bonus)` in priority order; depth K needs `glue`
    first. Branches that do not fit in the KV cache are left out (see `_admit`). `num_steps` defaults to
    each root's K; `propose` chooses the tokens (greedy by default); `keep_logits` keeps each step's
    logits (the next round's bonus distributions if the branch hits).
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
    ):
        if len(candidates) != len(roots):
            raise ValueError(f"{len(roots)} roots but {len(candidates)} candidate lists")
        if len({r.req_id for r in roots}) != len(roots):
            raise ValueError("a request appears twice among the roots")
        self.runner, self.propose, self.keep_logits, self.vocab_size = runner, propose, keep_logits, vocab_size
        steps = [num_steps if num_steps is not None else r.k for r in roots]
        groups, self.fork_copies, self.growth_blocks = _admit(runner, roots, candidates, steps)
        # (steps wanted, context length, branch), grouped by root
        self._flat = [(steps[r], roots[r].context_len, b) for r, group in enumerate(groups) for b in group]
        #: `fork_copies`: KV blocks copied by forks inside a block; `growth_blocks`: blocks reserved for the
        #: branches' tokens past a block edge (all of a round's blocks are taken here, none by `step`).
        #: candidates left out because the KV cache had no room for them
        self.dropped = sum(len(c) for c in candidates) - len(self._flat)
        self._logits: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self._flat]
        self._probs: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self._flat]
        self.steps_done = 0

    @property
    def live_rows(self) -> int:
        """Branches the next `step` advances."""
        return sum(1 for n, _, _ in self._flat if self.steps_done < n)

    @property
    def done(self) -> bool:
        return all(self.steps_done >= n for n, _, _ in self._flat)

    @torch.inference_mode()
    def step(self) -> None:
        """One `runner.forward` over every branch that wants more tokens."""
        s = self.steps_done
        live = [i for i, (n, _, _) in enumerate(self._flat) if s < n]
        self.steps_done += 1
        if not live:
            return
        chunks = []
        for i in live:
            _, ctx_len, b = self._flat[i]
            chunks.append((b.seq_id, [b.tokens[-1] if s else b.bonus], ctx_len + b.depth + s))
        logits = self.runner.forward(chunks)
        if self.vocab_size:
            logits = logits[:, : self.vocab_size]
        start, chosen = 0, []
        while start < len(live):  # one propose call per request: its branches are contiguous
            req_id = self._flat[live[start]][2].req_id
            end = start
            while end < len(live) and self._flat[live[end]][2].req_id == req_id:
                end += 1
            tokens, probs = self.propose(req_id, logits[start:end])
            chosen.append(tokens.reshape(-1))
            for row, i in enumerate(live[start:end]):
                if self.keep_logits:
                    self._logits[i].append((logits, start + row))
                if probs is not None:
                    self._probs[i].append((probs, row))
            start = end
        # every branch's token in one device-to-host transfer (not one per branch: 512 at batch 16 x 32)
        for i, tok in zip(live, torch.cat(chosen).tolist(), strict=True):
            self._flat[i][2].tokens.append(tok)

    def finish(self) -> list[Branch]:
        """The branches (grouped by root, in candidate order), each owning its runner sequence: free it, or
        `runner.adopt` it on a hit. Branches cut short before their first step have no tokens."""
        for (_, _, b), lg, pr in zip(self._flat, self._logits, self._probs, strict=True):
            b.logit_refs, b.prob_refs = lg, pr
        return [b for _, _, b in self._flat]
