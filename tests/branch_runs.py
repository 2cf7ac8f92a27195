"""A whole `BranchRun` in one call, for tests that check branches after all their steps."""
from __future__ import annotations

from collections.abc import Sequence

from saguaro_vllm.drafter.branches import Branch, BranchRoot, BranchRun, Propose, greedy
from saguaro_vllm.drafter.runner import DraftModelRunner


def draft_branches(
    runner: DraftModelRunner,
    roots: Sequence[BranchRoot],
    candidates: Sequence[Sequence[tuple[int, int]]],
    num_steps: int | None = None,
    propose: Propose = greedy,
    keep_logits: bool = False,
    vocab_size: int | None = None,
) -> list[Branch]:
    """All steps of a `BranchRun` at once: `num_steps` tokens (default K) for every admitted candidate."""
    run = BranchRun(runner, roots, candidates, num_steps, propose, keep_logits, vocab_size)
    while not run.done:
        run.step()
    return run.finish()
