"""Deliberately broken proposers, importable by engine processes, to show the exactness tests can fail."""
from __future__ import annotations

import torch

from saguaro_vllm.shared.proposal_buffers import assemble
from saguaro_vllm.worker.proposer import SaguaroProposer


class WrongProbsProposer(SaguaroProposer):
    """Hands the rejection sampler a uniform proposal instead of the q the drafts were sampled from."""

    def take_last_draft_probs(self):
        probs = super().take_last_draft_probs()
        if probs is not None:
            probs = probs.clone()
            probs[:] = 1.0 / probs.shape[-1]
        return probs


class UniformBackupProbsProposer(SaguaroProposer):
    """Verifies every draft of a sampled request that was chosen deterministically (n-gram backups, which
    must be verified one-hot) as if it had been drawn from a uniform proposal."""

    def propose(self, sampled_token_ids, *args, **kwargs):
        self._drafts = super().propose(sampled_token_ids, *args, **kwargs)
        return self._drafts

    def take_last_draft_probs(self):
        probs = super().take_last_draft_probs()
        rows = [i for i, d in enumerate(self._drafts) if d]
        if not rows:
            return probs
        if probs is None:
            probs = self._one_hot_probs(self._drafts)
        probs = probs.clone()
        one_hot = (probs.max(dim=-1).values == 1.0)  # deterministic drafts (and padding)
        probs[one_hot] = 1.0 / probs.shape[-1]
        return probs

    def _one_hot_probs(self, drafts: list[list[int]]) -> torch.Tensor | None:
        """One-hot q for every row with drafts (what vLLM assumes without probabilities), in a fresh tensor;
        sets the request ids like `_take_probs` (a greedy step's dense tensor)."""
        rows = [i for i, d in enumerate(drafts) if d]
        if not rows:
            return None
        buf = torch.empty(len(rows), self.k, self.vocab_size, dtype=torch.float32)
        probs, answer_rows = assemble(buf, [], [drafts[i] for i in rows], self.k)
        self._last_prob_req_ids = [self.runner.input_batch.req_ids[rows[j]] for j in answer_rows]
        return probs.to(self.runner.device)
