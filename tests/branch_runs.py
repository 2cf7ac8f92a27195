"""A whole `BranchRun` in one call, for tests that check branches after all their steps."""
from __future__ import annotations

from saguaro_vllm.drafter.branches import Branch, BranchRun


def draft_branches(*args, **kwargs) -> list[Branch]:
    """All steps of a `BranchRun(*args, **kwargs)` at once: `num_steps` tokens (default K) for every
    admitted candidate."""
    run = BranchRun(*args, **kwargs)
    while not run.done:
        run.step()
    return run.finish()
