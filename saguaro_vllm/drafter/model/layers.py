"""Building blocks shared by the draft model families: RMSNorm, RoPE, fused linears, the SiLU MLP.

Numerics follow Hugging Face's reference implementations (fp32 norm statistics, fp32 RoPE angles cast to
the activation dtype) so that the draft's distributions match the checkpoint's own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE computed from positions on the fly (no cache sized by the max context).

    `positions` are explicit, decoupled from cache slots, so branch tokens can sit in scratch slots.
    """

    def __init__(self, head_size: int, theta: float, scaling: dict | None = None):
        super().__init__()
        # Built on the CPU in fp32 even under a meta-device or low-precision construction context.
        exponent = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
        inv_freq = 1.0 / (theta**exponent)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self._inv_freq = inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [num_tokens, head_size], in `dtype`; computed once per forward pass."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_size]; cos/sin: [num_tokens, head_size]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Linear(nn.Linear):
    """nn.Linear whose matmul can be swapped for a faster path (`linear_kernels.install_linear_kernel`)."""

    kernel = None  # Callable[[Tensor], Tensor] once installed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)


class MergedLinear(nn.Module):
    """Several projections of one input fused into one matmul (q/k/v, gate/up).

    Checkpoints store the parts separately; `load_shard` copies each into its rows of the fused weight.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool):
        super().__init__()
        self.shard_sizes = dict(shard_sizes)
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in self.shard_sizes.items():
            self.offsets[name] = total
            total += size
        self.weight = nn.Parameter(torch.empty(total, in_features))
        self.bias = nn.Parameter(torch.empty(total)) if bias else None
        self.kernel = None  # a faster matmul path, see Linear

    def load_shard(self, param: nn.Parameter, shard: str, loaded: torch.Tensor) -> None:
        start, size = self.offsets[shard], self.shard_sizes[shard]
        if loaded.shape[0] != size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shard {shard!r}: expected rows {size} x {tuple(param.shape[1:])}, "
                             f"got {tuple(loaded.shape)}")
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        return y.split(list(self.shard_sizes.values()), dim=-1)


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(F.silu(gate) * up)
