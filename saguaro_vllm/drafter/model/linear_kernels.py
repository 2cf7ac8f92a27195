"""Matmul paths for the drafter's linear layers on CPU (`saguaro.linear`).

On CPU the draft step is dominated by its linear layers, and plain `F.linear` is not the fastest way to run
them: oneDNN with a pre-packed bf16 weight is ~1.4-1.5x faster than `F.linear` in bf16 for the 1-24 rows of
a multi-branch step, and int8 weights (fbgemm, activations quantized per call) are 2-3x faster up to ~13
rows (`benchmarks/experiments/bench_linear.py`, benchmarks/notes.md). Packing happens once at load; the float
weights are then released unless another module shares them (a tied embedding).

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
import weakref
from collections.abc import Callable

import torch
from torch import nn

from saguaro_vllm.drafter.model.layers import Linear, MergedLinear

LINEAR_KERNELS = ("auto", "plain", "packed", "onednn", "int8")


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


@functools.cache
def onednn_available() -> bool:
    """vLLM's own CPU GEMM (`torch.ops._C.onednn_mm` with a pre-packed oneDNN handler, what vLLM's CPU
    model runner uses for every unquantized linear layer) is loadable here: the drafter runs beside a vLLM
    install on CPU, but must not need one (GPU checks run without vLLM). Probed once on a tiny weight."""
    try:
        import vllm._C  # noqa: F401  (registers torch.ops._C; ~3 s at a drafter's start)
    except Exception:  # noqa: BLE001 - any failure means: not available
        return False
    if not (hasattr(torch.ops._C, "create_onednn_mm_handler") and hasattr(torch.ops._C, "onednn_mm")):
        return False
    try:
        _onednn(torch.zeros(8, 8), None)(torch.zeros(1, 8))
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
        if on_cpu and dtype == "bfloat16" and packed_available():
            return "packed"
        return "onednn" if on_cpu and dtype in ("float32", "bfloat16") and onednn_available() else "plain"
    if requested == "onednn" and not (on_cpu and dtype in ("float32", "bfloat16") and onednn_available()):
        raise ValueError(f"'onednn' needs the drafter on CPU in float32 or bfloat16 beside vLLM's CPU build "
                         f"(torch.ops._C.onednn_mm; device {device}, dtype {dtype}); use 'auto' or 'plain'")
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


#: Primitives each oneDNN handler keeps (one per padded row bucket: every bucket up to 2048 rows fits).
ONEDNN_PRIMITIVES = 96


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's CPU GEMM: the weight packed once into a oneDNN handler (which owns the packed copy), rows
    padded to buckets like `_packed_bf16` (one primitive per bucket, built by `warm_linear_kernels`).
    Measured on one core (float32, `benchmarks/notes.md`): an LM head of 128256 x 64 at 16 rows 5.9 ms against
    `F.linear`'s 8.3 ms, at 4 rows 1.9 against 5.8; a 2048 x 2048 layer at 16 rows 1.35 against 2.5 ms."""
    handler = torch.ops._C.create_onednn_mm_handler(weight.detach().t(), ONEDNN_PRIMITIVES)
    handle = torch.tensor(handler, dtype=torch.int64)
    release = torch.ops._C.release_dnnl_matmul_handler
    b = None if bias is None else bias.detach().clone()
    n = weight.shape[0]
    # One row: oneDNN's packed GEMM is slower than F.linear's GEMV for wide layers (an LM head of 128256 x 64:
    # 2.1 against 1.4 ms), faster for square ones (2048 x 2048: 0.32 against 0.50 ms). Timed once here;
    # where F.linear wins, the float weight is kept for one-row calls (its memory is not released).
    one_row = _faster_plain_one_row(weight.detach(), b, handle)

    def run(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows = x2.shape[0]
        if rows == 1 and one_row is not None:
            return torch.nn.functional.linear(x2, one_row, b).reshape(*shape[:-1], n)
        pad = padded_rows(rows) - rows
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        y = torch.empty(x2.shape[0], n, dtype=x.dtype)
        torch.ops._C.onednn_mm(y, x2, b, handle)
        if pad:
            y = y[:rows]
        return y.reshape(*shape[:-1], n)

    run.shape_key = (weight.shape[1], weight.shape[0], weight.dtype, bias is not None)  # rows padded
    run.handle = handle
    weakref.finalize(run, release, handler)  # the handler (and its packed weight) goes with the kernel
    return run


def _faster_plain_one_row(weight: torch.Tensor, bias: torch.Tensor | None, handle: torch.Tensor,
                          repeats: int = 5) -> torch.Tensor | None:
    """`weight` if `F.linear` beats the oneDNN handler on one row by more than 20 % (best of `repeats`)."""
    x = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
    y = torch.empty(1, weight.shape[0], dtype=weight.dtype)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    with torch.inference_mode():
        plain = best(lambda: torch.nn.functional.linear(x, weight, bias))
        dnn = best(lambda: torch.ops._C.onednn_mm(y, x, bias, handle))
    return weight if plain < 0.8 * dnn else None


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
    make = {"packed": _packed_bf16, "onednn": _onednn, "int8": _int8_dynamic}[kernel]
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

