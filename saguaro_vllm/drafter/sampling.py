"""The drafter's one proposal sampler: q' per row and one token drawn from exactly those floats.

Exactness does not depend on matching the target's sampler: any proposal q is exact as long as the
verifier receives exactly the q the token was drawn from. Honouring the request's temperature, top-k and
top-p in q only raises acceptance (a token outside the target's top-k/top-p set is always rejected); Saguaro
sampling scales the top-F probabilities by C (`ops.proposal_probs`, compiled on CPU and CUDA). Greedy
drafts need no q at all: vLLM verifies them one-hot, and the callers take the argmax.

Noise: each sampled request has its own generator (`request_generator`), one uniform per drawn token. For a
request with a `seed` it is seeded from a value derived from that seed, never the seed itself: vLLM seeds the
target's per-request generator with the plain seed, so a drafter seeded alike would reuse the target's own
random numbers and its draft would be correlated with the target's sample, which biases acceptance.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from saguaro_vllm.ops import proposal_probs

if TYPE_CHECKING:  # annotations only: the op tests import this module where pyzmq may be missing
    from saguaro_vllm.shared.transport import SamplingSpec


def sample_proposals(logits: torch.Tensor, specs: Sequence[SamplingSpec],
                     generators: Sequence[torch.Generator | None], saguaro_f: Sequence[int] | int = 0,
                     saguaro_c: Sequence[float] | float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows' drafts: (tokens [n] int64, q' [n, vocab] float32). Row i's q' is its request's
    proposal (`specs[i]`: temperature, top-k, top-p) with its top `saguaro_f[i]` probabilities scaled by
    `saguaro_c[i]`, in one batched op call; its token is drawn from exactly that row with `generators[i]`."""
    def per_row(values):  # Python lists: the op decides its fast path on the host, no device sync
        return [v for v in values] if isinstance(values, Sequence) else [values] * len(specs)

    q = proposal_probs(logits, per_row([s.temperature for s in specs]), per_row([s.top_k for s in specs]),
                       per_row([s.top_p for s in specs]), per_row(saguaro_f), per_row(saguaro_c))
    return sample_rows(q, generators), q


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab], row i drawn exactly from it with `generators[i]` (CPU
    generators; None: the global RNG): inverse CDF over a float64 cumulative sum with one float64 uniform per
    row. One random number per row instead of one per vocabulary entry (torch's CPU `exponential_` over 128k
    entries costs ~6 ms a row); a token of probability 0 is never drawn (its cumulative sum does not rise)."""
    u = torch.empty(len(generators), dtype=torch.float64)
    i = 0
    while i < len(generators):  # one call per run of rows sharing a generator (e.g. one request's branches)
        j = i + 1
        while j < len(generators) and generators[j] is generators[i]:
            j += 1
        u[i:j] = torch.rand(j - i, generator=generators[i], dtype=torch.float64)
        i = j
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    x = torch.minimum(u.to(probs.device).unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


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


def request_generator(seed: int | None) -> torch.Generator:
    """A sampled request's own (CPU) generator: from `draft_seed(seed)` (reproducible) or, without a seed,
    from fresh OS randomness. CPU even for a CUDA drafter: it draws one number per token."""
    gen = torch.Generator()
    gen.manual_seed(draft_seed(seed) if seed is not None else int.from_bytes(os.urandom(8), "little"))
    return gen
