"""The draft's proposal distribution and sampling from it.

Exactness does not depend on matching the target's sampler: any proposal q is exact as long as the
verifier receives exactly the q the token was drawn from. Honouring the request's temperature, top-k and
top-p in q only raises acceptance (a token outside the target's top-k/top-p set is always rejected).
Deterministically chosen tokens (greedy drafts) need no q at all: vLLM verifies them one-hot.
"""
from __future__ import annotations

import torch

from saguaro_vllm.transport import SamplingSpec


def proposal_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """float32 [n, vocab] proposal from draft logits at the request's temperature, top-k and top-p."""
    x = logits.float() / spec.temperature
    vocab = x.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(x, spec.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - spec.top_p
        drop[..., -1] = False  # always keep the most likely token
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(dim=-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs`, drawn exactly from it (exponential race: argmax p / E, E ~ Exp(1))."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e).argmax(dim=-1)
