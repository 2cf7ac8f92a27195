"""Branch helpers for tests: the glue forward and bonus distributions of the pre-draft (which
`PreDrafter._glue` does in one forward with the context tail), and a whole `BranchRun` in one call."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from saguaro_vllm.drafter.branches import Branch, BranchRoot, BranchRun
from saguaro_vllm.drafter.runner import DraftModelRunner


@torch.inference_mode()
def glue(runner: DraftModelRunner, roots: Sequence[BranchRoot], vocab_size: int | None = None) -> torch.Tensor:
    """Feed each root's last draft x_K: writes the KV the depth-K branches fork from and returns the
    depth-K bonus logits `[len(roots), vocab]`. Raises OutOfBlocksError (changing nothing) if the roots
    do not all fit; `runner.reserve(req_id, 1)` first to pick the ones that do."""
    for r in roots:
        if r.k < 1 or runner.num_computed(r.req_id) != r.context_len + r.k - 1:
            raise ValueError(f"request {r.req_id!r}: glue needs KV for context + drafts[:-1] "
                             f"({r.context_len + r.k - 1} tokens), {runner.num_computed(r.req_id)} are computed")
    logits = runner.forward([(r.req_id, [r.drafts[-1]], r.context_len + r.k - 1) for r in roots])
    return logits[:, :vocab_size] if vocab_size else logits


def bonus_distributions(draft_logits: Sequence[torch.Tensor], glue_logits: torch.Tensor) -> torch.Tensor:
    """`[K+1, vocab]`: row j < K is the distribution x_{j+1} was drafted from (the draft's guess of the bonus
    token if exactly j drafts are accepted), row K the glue's."""
    rows = [d[0][d[1]] if isinstance(d, tuple) else d for d in draft_logits]  # (tensor, row) references
    return torch.cat([torch.stack(rows), glue_logits[None]])


def draft_branches(*args, **kwargs) -> list[Branch]:
    """All steps of a `BranchRun(*args, **kwargs)` at once: `num_steps` tokens (default K) for every
    admitted candidate."""
    run = BranchRun(*args, **kwargs)
    while not run.done:
        run.step()
    return run.finish()
