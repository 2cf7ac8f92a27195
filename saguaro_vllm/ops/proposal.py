"""The draft's proposal q' and sampling from it, batched over rows (design: ssd-algorithm.md §6).

q' = the request's temperature / top-k / top-p distribution with its top-F probabilities multiplied by C
(Saguaro sampling), renormalised. Tokens are drawn by Gumbel-max with noise the caller draws from each
request's own generator (`draw_gumbel`), so every implementation returns the same tokens for the same
noise, and the verifier receives exactly the q' each token was drawn from. Exact semantics (ties, top-p at
equal values, C = 0): `reference.sample_proposal`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from saguaro_vllm.ops import loader, reference


def draw_gumbel(
    num_rows: int,
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[num_rows, vocab] float32 Gumbel(0, 1) noise, row i from `generators[i]` (None: the global RNG)."""
    noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)
    i = 0
    while i < num_rows:  # one draw per run of rows sharing a generator (e.g. one request's branches)
        gen = generators[i] if generators is not None else None
        j = i + 1
        while j < num_rows and (generators[j] if generators is not None else None) is gen:
            j += 1
        noise[i:j].exponential_(1.0, generator=gen)
        i = j
    return noise.log_().neg_()


def _per_row(value, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(n).contiguous()
    return torch.full((n,), value, dtype=dtype, device=device)


def sample_proposal(
    logits: torch.Tensor,
    gumbel: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    saguaro_f: torch.Tensor | int = 0,
    saguaro_c: torch.Tensor | float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` [n, V] -> (tokens [n] int64, q' [n, V] float32). Per-row parameters are tensors [n] or
    scalars; temperature <= 0 means greedy (argmax, one-hot q'). `saguaro_c` must lie in [0, 1]."""
    n, dev = logits.shape[0], logits.device
    c = _per_row(saguaro_c, n, torch.float32, dev)
    if bool(((c < 0) | (c > 1)).any()):
        raise ValueError("saguaro_c must lie in [0, 1]")
    args = (
        _per_row(temperature, n, torch.float32, dev),
        _per_row(top_k, n, torch.int64, dev),
        _per_row(top_p, n, torch.float32, dev),
        _per_row(saguaro_f, n, torch.int64, dev),
        torch.log(c),  # computed once here so every implementation uses the same bits
    )
    if loader.use_compiled(dev):
        return torch.ops.saguaro.sample_proposal(logits, gumbel, *args)
    return reference.sample_proposal(logits, gumbel, *args)
