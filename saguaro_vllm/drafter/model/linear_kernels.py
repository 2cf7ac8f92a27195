"""Matmul paths for the drafter's linear layers on CPU (`saguaro.linear`).

On CPU the draft step is dominated by its linear layers, and plain `F.linear` is not the fastest way to run
them: oneDNN with a pre-packed bf16 weight is ~1.4-1.5x faster than `F.linear` in bf16 for the 1-24 rows of
a multi-branch step, and int8 weights (fbgemm, activations quantized per call) are 2-3x faster up to ~13
rows (`benchmarks/bench_linear.py`, docs/ops.md). Packing happens once at load; the float weights are then
released unless another module shares them (a tied embedding).

Exactness does not depend on the path: the drafter sends the verifier the probabilities it actually sampled
from, so int8's different draft distribution changes the acceptance rate, never the output.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn

from saguaro_vllm.drafter.model.layers import Linear, MergedLinear

LINEAR_KERNELS = ("auto", "plain", "packed", "int8")


@functools.cache
def packed_available() -> bool:
    """oneDNN's packed bf16 linear exists in this torch build AND runs on this CPU (it needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT: without them the reorder raises), probed once on a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        _packed_bf16(torch.zeros(8, 8, dtype=torch.bfloat16), None)(torch.zeros(1, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_linear(requested: str, device: str, dtype: str) -> str:
    """The concrete path for `saguaro.linear`; raises ValueError (naming the fix) where it cannot run."""
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"must be one of {', '.join(LINEAR_KERNELS)}")
    on_cpu = device == "cpu"
    if requested == "auto":
        return "packed" if on_cpu and dtype == "bfloat16" and packed_available() else "plain"
    if requested == "packed" and not (on_cpu and dtype == "bfloat16" and packed_available()):
        raise ValueError(f"'packed' needs the drafter on CPU in bfloat16 with oneDNN (device {device}, dtype "
                         f"{dtype}) on a CPU that oneDNN's bf16 path supports (AVX-512 or AVX-NE-CONVERT); use 'auto' or 'plain'")
    if requested == "int8" and not (on_cpu and int8_available()):
        raise ValueError(f"'int8' needs the drafter on CPU with torch's fbgemm engine (device {device}); use "
                         "'auto' or 'plain'")
    return requested


def _packed_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    b = None if bias is None else bias.detach().clone()

    def run(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, b, "none", [], "")
        return y.reshape(*shape[:-1], y.shape[-1])

    return run


def _cpu_has_vnni(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


#: Without VNNI, fbgemm multiplies u8 x s8 pairs into saturating int16 sums (vpmaddubsw): activations must be
#: quantized to 7 bits or large products overflow (seen on an AVX2-only CPU: errors of 0.1-0.13 of the output
#: scale at 7+ rows against 0.04 with 7 bits).
_INT8_REDUCE_RANGE = not _cpu_has_vnni()


def _int8_dynamic(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-output-channel symmetric int8 weights; fbgemm quantizes the activations per call."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's kernels still ship
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "fbgemm"
        qw = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.detach().float())

    def run(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, shape[-1]).float().contiguous(), packed,
                                               _INT8_REDUCE_RANGE)
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)

    return run


def install_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Switch every linear layer of `model` to `kernel` (a resolved path); returns how many were switched."""
    if kernel == "plain":
        return 0
    make = {"packed": _packed_bf16, "int8": _int8_dynamic}[kernel]
    tied = {id(p) for name, m in model.named_modules() if not isinstance(m, (Linear, MergedLinear))
            for p in m.parameters(recurse=False)}
    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, MergedLinear)):
            module.kernel = make(module.weight, module.bias)
            if id(module.weight) not in tied:  # the packed copy replaces it
                module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype,
                                                         device=module.weight.device), requires_grad=False)
            count += 1
    return count

