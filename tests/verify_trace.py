"""Which verification path every step took, on every worker rank (test helper, not a test).

Installed per runner instance through `collective_rpc` (like tp_engine.py's committed-token recorder): the
runner's own `_sample` and its rejection sampler's `forward` are wrapped on the instance, outside Saguaro's
class-level patches, so no vLLM or Saguaro code is changed for it. For every step that verified drafts it
records one `Step`:
- `batch`: rows in the step; `drafted`: rows with drafts; `draft_tokens`, `accepted`: their sums;
  `rejected`: drafted rows that kept fewer tokens than they had drafts (a rejection);
- `path`: how this rank verified: "greedy" (an all-greedy batch: argmax, `greedy_rejection.py`'s fast path or
  vLLM's), "q" (sampled rows verified against Saguaro's proposal probabilities), "onehot" (sampled rows
  verified without them, as if q were one-hot: every TP rank but rank 0, and rank 0 when no q came);
- `replaced`: rows whose tokens this rank kept differ from what its own verification produced: TP rank 0's
  tokens taken in their place (`patches/tp_sampling.py`); always 0 on rank 0 and at TP=1;
- `hits`, `misses`, `ngram`, `sampled` (mode async, on the rank that talks to the drafter): of the drafter's
  answer whose drafts this step verifies, the speculation-cache hits and misses, the misses answered by the
  n-gram backup (deterministic drafts) and the draft tokens sampled from q' (the growth of the proposer's
  `SaguaroMetrics` since the previous step's sampling: the proposer runs after the sampling, in the same step).
  A sampled step of rank 0 takes path "onehot" only when no drafted row has q: drafts chosen deterministically
  (`sampled` 0), which vLLM verifies one-hot, exactly.
`accepted` and `rejected` count the tokens the rank kept (rank 0's, after the broadcast).

    llm.collective_rpc(install_verify_trace)
    ... generate ...
    per_rank = llm.collective_rpc(read_verify_paths)   # [{"steps": [...], "shortcuts": {...}, ...}, ...]
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: a rejected position of `sampled_token_ids`


@dataclasses.dataclass
class Step:
    batch: int
    drafted: int
    path: str
    draft_tokens: int
    accepted: int
    rejected: int
    replaced: int
    hits: int = 0
    misses: int = 0
    ngram: int = 0
    sampled: int = 0


def install_verify_trace(worker: Any) -> bool:
    """collective_rpc: record every verification step of this worker's runner (False: no rejection sampler)."""
    runner = worker.model_runner
    sampler = getattr(runner, "rejection_sampler", None)
    runner.saguaro_verify_steps = []
    if sampler is None:
        return False
    forward, sample = sampler.forward, runner._sample
    own: dict[str, Any] = {}
    seen = [0, 0, 0, 0]  # the proposer's hits, lookups, n-gram backups, sampled drafts at the last sampling

    def traced_forward(metadata, draft_probs, logits, sampling_metadata):
        out = forward(metadata, draft_probs, logits, sampling_metadata)
        own["tokens"] = out.sampled_token_ids.clone()  # this rank's own result, before any broadcast
        own["path"] = ("greedy" if sampling_metadata.all_greedy else "q" if draft_probs is not None else "onehot")
        return out

    def traced_sample(logits, spec_decode_metadata):
        own.clear()
        metrics = getattr(getattr(runner, "drafter", None), "metrics", None)
        now = ([metrics.hits, metrics.lookups, metrics.backups.get("ngram", 0), metrics.sampled_drafts]
               if metrics is not None else [0, 0, 0, 0])
        hits, lookups, ngram, sampled = (a - b for a, b in zip(now, seen))
        seen[:] = now
        out = sample(logits, spec_decode_metadata)
        if spec_decode_metadata is not None and own and any(spec_decode_metadata.num_draft_tokens):
            step = _step(spec_decode_metadata.num_draft_tokens, own["path"], own["tokens"], out.sampled_token_ids)
            step.hits, step.misses, step.ngram, step.sampled = hits, lookups - hits, ngram, sampled
            runner.saguaro_verify_steps.append(dataclasses.asdict(step))
        return out

    sampler.forward = traced_forward
    runner._sample = traced_sample
    return True


def _step(num_draft: Sequence[int], path: str, own_tokens: Any, kept_tokens: Any) -> Step:
    own, kept = own_tokens.cpu().tolist(), kept_tokens.cpu().tolist()
    drafted = [i for i, n in enumerate(num_draft) if n]
    accepted = {i: sum(t != PLACEHOLDER for t in kept[i]) - 1 for i in drafted}
    return Step(batch=len(num_draft), drafted=len(drafted), path=path,
                draft_tokens=sum(num_draft[i] for i in drafted), accepted=sum(accepted.values()),
                rejected=sum(accepted[i] < num_draft[i] for i in drafted),
                replaced=sum(a != b for a, b in zip(own, kept)))


def read_verify_paths(worker: Any) -> dict[str, Any]:
    """collective_rpc: this rank's recorded steps and Saguaro's per-process path counters."""
    from saguaro_vllm.patches import SHORTCUT_STEPS, TP_RANK0_TOKEN_STEPS

    return {"steps": list(getattr(worker.model_runner, "saguaro_verify_steps", [])),
            "shortcuts": dict(SHORTCUT_STEPS), "rank0_tokens": dict(TP_RANK0_TOKEN_STEPS)}


def paths_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one job added to one rank's `read_verify_paths`."""
    return {"steps": after["steps"][len(before["steps"]):],
            **{k: {n: v - before[k].get(n, 0) for n, v in after[k].items()} for k in ("shortcuts", "rank0_tokens")}}


@dataclasses.dataclass
class RankPaths:
    """One rank's verification in one job (`paths_delta`), with the sums the tests assert on."""

    steps: list[Step]
    shortcuts: dict[str, int]
    rank0_tokens: dict[str, int]

    @classmethod
    def of(cls, delta: dict[str, Any]) -> RankPaths:
        return cls([Step(**s) for s in delta["steps"]], delta["shortcuts"], delta["rank0_tokens"])

    def select(self, path: str | None = None, *, batch: int | None = None) -> list[Step]:
        return [s for s in self.steps if (path is None or s.path == path) and (batch is None or s.batch == batch)]

    def paths(self) -> dict[str, int]:
        """Steps per path."""
        out: dict[str, int] = {}
        for s in self.steps:
            out[s.path] = out.get(s.path, 0) + 1
        return out


def totals(steps: Iterable[Step]) -> dict[str, int]:
    steps = list(steps)
    return {"steps": len(steps), **{f: sum(getattr(s, f) for s in steps) for f in
                                    ("drafted", "draft_tokens", "accepted", "rejected", "replaced", "hits", "misses",
                                     "ngram", "sampled")}}
