"""The draft's proposal q', batched over rows with per-row parameters (design: ssd-algorithm.md §6).

q' = the request's temperature / top-k / top-p distribution with its top-F probabilities multiplied by C
(Saguaro sampling), renormalised. The op only computes q'; the drafter draws each token from the very
floats it returns (`drafter/sampling.py`), which is what the verifier receives, so exactness does not depend
on the implementations agreeing bit for bit. Exact semantics (ties, top-p at equal values, C = 0):
`reference.proposal_probs`.
"""

from __future__ import annotations

import torch

from saguaro_vllm.ops import loader, reference


def _per_row(value, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(n).contiguous()
    if isinstance(value, (list, tuple)):  # built on the host, then one copy the host does not wait for
        # (`torch.tensor(..., device=cuda)` would wait for the device: five waits per call)
        t = torch.tensor(value, dtype=dtype)
        return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)
    return torch.full((n,), value, dtype=dtype, device=device)


def _host(value, n: int) -> list | None:
    """Per-row values known on the host (a scalar, a list), or None for a tensor (checked on its device)."""
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.device.type == "cpu" else None
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def proposal_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int = 0,
    top_p: torch.Tensor | float = 1.0,
    saguaro_f: torch.Tensor | int = 0,
    saguaro_c: torch.Tensor | float = 1.0,
) -> torch.Tensor:
    """`logits` [n, V] -> q' [n, V] float32. Per-row parameters are tensors [n] or scalars; temperature <= 0
    means greedy (one-hot q'). `saguaro_c` must lie in [0, 1]."""
    n, dev = logits.shape[0], logits.device
    host = [_host(v, n) for v in (temperature, top_k, top_p, saguaro_f, saguaro_c)]
    c = _per_row(saguaro_c, n, torch.float32, dev)
    if host[4] is not None:  # parameters the caller passed as Python values: decided without a device sync
        if any(not 0.0 <= x <= 1.0 for x in host[4]):
            raise ValueError("saguaro_c must lie in [0, 1]")
    elif bool(((c < 0) | (c > 1)).any()):
        raise ValueError("saguaro_c must lie in [0, 1]")
    args = (
        _per_row(temperature, n, torch.float32, dev),
        _per_row(top_k, n, torch.int64, dev),
        _per_row(top_p, n, torch.float32, dev),
        _per_row(saguaro_f, n, torch.int64, dev),
        torch.log(c),  # computed once here so every implementation uses the same bits
    )
    t, k, p, f, _ = args
    vocab = logits.shape[-1]
    if None not in host:
        plain = all(tt > 0 and (kk <= 0 or kk >= vocab) and pp >= 1 and (ff <= 0 or cc >= 1)
                    for tt, kk, pp, ff, cc in zip(*host, strict=True))
    else:
        plain = bool(((t > 0) & ((k <= 0) | (k >= vocab)) & (p >= 1) & ((f <= 0) | (c >= 1))).all())
    if plain:
        # No row has top-k, top-p or scaling: q' is the plain softmax, vectorised by torch (the kernels'
        # per-row passes cost ~4x more at vocab 128k on one CPU thread; benchmarks/notes.md).
        return torch.softmax(logits.float() / t[:, None], dim=-1)
    if loader.use_compiled(dev):
        return torch.ops.saguaro.proposal_probs(logits, *args)
    return reference.proposal_probs(logits, *args)
