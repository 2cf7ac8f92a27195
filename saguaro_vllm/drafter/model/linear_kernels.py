"""Matmul paths for the drafter's linear layers on CPU (`saguaro.linear`).

On CPU the draft step is dominated by its linear layers, and plain `F.linear` is not the fastest way to run
them: oneDNN with a pre-packed bf16 weight is ~1.4-1.5x faster than `F.linear` in bf16 for the 1-24 rows of
a multi-branch step, and int8 weights (fbgemm, activations quantized per call) are 2-3x faster up to ~13
rows (`benchmarks/bench_linear.py`, docs/ops.md). Packing happens once at load; the float weights are then
released unless another module shares them (a tied embedding).

oneDNN builds (and JIT-compiles) one primitive per input row count and keeps it in a bounded cache, about
0.5 MB each in bf16: a drafter that sees every row count from 1 to a few hundred grows by hundreds of MB over
its first minutes and keeps re-creating evicted primitives. The packed path therefore pads the rows up to a
bucket (`padded_rows`: exact up to 16, then 8 buckets per doubling, at most 12.5 % padding) and
`warm_linear_kernels` builds every bucket's primitive at start, so the drafter's memory is flat from its first
step and no step pays a primitive's creation (docs/troubleshooting.md, "memory").

Exactness does not depend on the path: the drafter sends the verifier the probabilities it actually sampled
from, so int8's different draft distribution changes the acceptance rate, never the output.
"""
from __future__ import annotations

import functools
import time
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


#: Row counts up to this run unpadded (decode and branch steps live here; 16 primitives per weight shape).
EXACT_ROWS = 16


def padded_rows(rows: int) -> int:
    """The bucket `rows` is padded to: `rows` itself up to EXACT_ROWS, then the next multiple of 1/8 of the
    power of two below it (17 -> 18, 100 -> 104, 1000 -> 1024), so padding stays under 12.5 % and there are
    8 buckets per doubling (about 70 up to 8192 rows)."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a call with 1..max_rows rows can land in, ascending."""
    out, rows = [], 1
    while rows <= max_rows:
        out.append(padded_rows(rows))
        rows = out[-1] + 1
    return out


def _packed_bf16(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    b = None if bias is None else bias.detach().clone()

    def run(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        pad = padded_rows(rows) - rows
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        y = torch.ops.mkldnn._linear_pointwise(x2, packed, b, "none", [], "")
        if pad:
            y = y[:rows]
        return y.reshape(*shape[:-1], y.shape[-1])

    run.shape_key = (weight.shape[1], weight.shape[0], weight.dtype, bias is not None)  # rows padded
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


def warm_linear_kernels(model: nn.Module, max_rows: int, budget_s: float = 10.0) -> tuple[int, float]:
    """Run each distinct weight shape's padded kernel once per row bucket, smallest first, up to `max_rows`
    or until `budget_s` is spent (a large drafter's biggest prefill buckets are then built on first use), so
    oneDNN has built the primitives of every decode and branch step before the first one. Returns the
    largest bucket warmed (0: nothing pads rows) and the seconds it took. Plain and int8 kernels do not pad
    and are left alone."""
    seen: dict[tuple, Callable] = {}
    for module in model.modules():
        key = getattr(getattr(module, "kernel", None), "shape_key", None)
        if isinstance(module, (Linear, MergedLinear)) and key is not None:
            seen.setdefault(key, module.kernel)
    if not seen:
        return 0, 0.0
    buckets = row_buckets(max_rows)
    inputs = {(k[0], k[2]): torch.zeros(buckets[-1], k[0], dtype=k[2]) for k in seen}
    start, warmed = time.perf_counter(), 0
    with torch.inference_mode():
        for rows in buckets:
            if warmed and time.perf_counter() - start > budget_s:
                break
            for (in_features, _, dtype, _), kernel in seen.items():
                kernel(inputs[in_features, dtype][:rows])
            warmed = rows
    return warmed, time.perf_counter() - start


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

