"""The draft's proposal distribution and sampling from it.

Exactness does not depend on matching the target's sampler: any proposal q is exact as long as the
verifier receives exactly the q the token was drawn from. Honouring the request's temperature, top-k and
top-p in q only raises acceptance (a token outside the target's top-k/top-p set is always rejected).
Deterministically chosen tokens (greedy drafts) need no q at all: vLLM verifies them one-hot.

Noise: each sampled request has its own generator (`request_generator`). For a request with a `seed` it is
seeded from a value derived from that seed, never the seed itself: vLLM seeds the target's per-request
generator with the plain seed, and on CUDA both would read the same Philox stream (the target's exponential
race, our uniforms), so a drafter seeded alike would reuse the target's own random numbers and its draft
would be correlated with the target's sample, which biases acceptance.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch

from saguaro_vllm.transport import SamplingSpec


def proposal_probs(logits: torch.Tensor, spec: SamplingSpec, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [n, vocab] proposal from draft logits at the request's temperature, top-k and top-p; written
    into `out` (e.g. rows of a shared proposal slot) when given."""
    x = logits.float()
    if spec.temperature != 1.0:  # x / 1.0 == x bit for bit: skip a pass over the vocabulary
        x = x / spec.temperature
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
    if out is not None:
        return torch.softmax(x, dim=-1, out=out)
    return x.softmax(dim=-1)


def proposal_probs_rows(logits: torch.Tensor, specs: Sequence[SamplingSpec], out: torch.Tensor) -> torch.Tensor:
    """`proposal_probs` for rows with their own specs, into `out` [n, vocab]: one batched call per distinct
    (temperature, top-k, top-p), not one per row (at a 128k vocabulary a call costs about a millisecond)."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((spec.temperature, spec.top_k, spec.top_p), []).append(i)
    if len(groups) == 1:
        return proposal_probs(logits, specs[0], out=out)
    for rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = proposal_probs(logits[idx], specs[rows[0]])
    return out


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab], row i drawn exactly from it with `generators[i]` (None: the
    global RNG): inverse CDF over a float64 cumulative sum with one float64 uniform per row. One random
    number per row instead of one per vocabulary entry (torch's CPU `exponential_` over 128k entries costs
    ~6 ms a row); a token of probability 0 is never drawn (its cumulative sum does not rise)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    x = torch.minimum(u.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs`, drawn exactly from it (exponential race: argmax p / E, E ~ Exp(1))."""
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e).argmax(dim=-1)


#: Domain tag of the drafter's generators: its streams are not the target's for any seed.
DRAFT_SEED_TAG = b"saguaro-draft"


def draft_seed(seed: int) -> int:
    """The drafter's 64-bit seed for a request whose `SamplingParams.seed` is `seed`: a fixed hash
    (BLAKE2b of a domain tag and the seed), the same in every process and run, unrelated to `seed` itself.

    >>> draft_seed(0) == draft_seed(0) != draft_seed(1)
    True
    """
    digest = hashlib.blake2b(DRAFT_SEED_TAG + int(seed).to_bytes(16, "little", signed=True), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def request_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A sampled request's own generator: from `draft_seed(seed)` (reproducible) or, without a seed,
    from fresh OS randomness."""
    gen = torch.Generator(device=device)
    gen.manual_seed(draft_seed(seed) if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return gen
