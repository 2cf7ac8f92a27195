"""Deliberately broken proposers, importable by engine processes, to show the exactness tests can fail."""
from __future__ import annotations

from saguaro_vllm.proposer import SaguaroProposer


class WrongProbsProposer(SaguaroProposer):
    """Hands the rejection sampler a uniform proposal instead of the q the drafts were sampled from."""

    def take_last_draft_probs(self):
        probs = super().take_last_draft_probs()
        if probs is not None:
            probs = probs.clone()
            probs[:] = 1.0 / probs.shape[-1]
        return probs
