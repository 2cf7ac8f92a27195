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


@torch.inference_mode()
def reference_branches(runner: DraftModelRunner, roots: Sequence[BranchRoot], candidates, num_steps: int | None = None,
                       propose=None, max_steps: int | None = None) -> tuple[list[Branch], list[list], list[list]]:
    """What `BranchRun` did before its batched path, kept as the reference it is tested against: fork and
    reserve one candidate at a time (rank by rank across requests, a fork whose growth does not fit freed
    again), then per step one `runner.forward` of `(seq_id, [token], position)` chunks and one `propose` call
    per request. Runs `max_steps` steps (default all). Returns (branches, per branch its logits rows, per branch
    its proposal rows)."""
    from saguaro_vllm.drafter.branches import branch_seq_id, greedy
    from saguaro_vllm.drafter.kv_cache import OutOfBlocksError

    propose = propose or greedy
    steps = [num_steps if num_steps is not None else r.k for r in roots]
    flat = []  # (steps, root, branch)
    admitted = [[] for _ in roots]
    for rank in range(max((len(c) for c in candidates), default=0)):
        for r, root in enumerate(roots):
            if rank >= len(candidates[r]) or steps[r] < 1:
                continue
            depth, bonus = candidates[r][rank]
            seq_id = branch_seq_id(root.req_id, depth, bonus)
            try:
                runner.fork(root.req_id, seq_id, root.context_len + depth)
            except OutOfBlocksError:
                continue
            try:
                runner.reserve(seq_id, steps[r])
            except OutOfBlocksError:
                runner.free_request(seq_id)
                continue
            admitted[r].append(Branch(root.req_id, depth, bonus, seq_id, []))
    flat = [(steps[r], roots[r], b) for r, group in enumerate(admitted) for b in group]
    logits_of = [[] for _ in flat]
    probs_of = [[] for _ in flat]
    total = max(steps, default=0) if max_steps is None else max_steps
    for s in range(total):
        live = [i for i, (n, _, _) in enumerate(flat) if s < n]
        if not live:
            break
        chunks = [(flat[i][2].seq_id, [flat[i][2].tokens[-1] if s else flat[i][2].bonus],
                   flat[i][1].context_len + flat[i][2].depth + s) for i in live]
        logits = runner.forward(chunks)
        start = 0
        while start < len(live):
            req_id = flat[live[start]][2].req_id
            end = start
            while end < len(live) and flat[live[end]][2].req_id == req_id:
                end += 1
            tokens, probs = propose(req_id, logits[start:end])
            for row, i in enumerate(live[start:end]):
                flat[i][2].tokens.append(int(tokens.reshape(-1)[row]))
                logits_of[i].append(logits[start + row])
                if probs is not None:
                    probs_of[i].append(probs[row])
            start = end
    return [b for _, _, b in flat], logits_of, probs_of
