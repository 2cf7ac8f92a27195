"""Three bugs of vLLM 0.32's CPU build, two that break speculative sampling, fixed by wrapping.

1. `vllm.utils.cpu_triton_utils._expand_kernel_impl` is the CPU stand-in for the Triton kernel
   `rejection_sampler.expand_kernel`, which expands per-request sampling parameters (temperature,
   top-k, top-p) to one value per draft token. It hands the C++ op `_ensure_int64(output)`: for a
   float32 (temperature, top-p) or int32 (top-k) output that is a temporary int64 copy, so the real
   output keeps whatever `new_empty` left in it and the rejection sampler scales the target logits at
   draft positions by garbage temperatures (and its input is truncated to int64 as well: 0.7 -> 0).
   Every speculative method at temperature > 0 on CPU samples from the wrong distribution
   (vllm issue #55005, PR #55006). Fix: outputs the op handles correctly (int64) still go to it; any
   other dtype is expanded at its own dtype, in place, with the exact semantics of the Triton kernel.

   How it is reached: `CpuPlatform.register_triton_kernel_overrides()` (called by
   `WorkerWrapperBase.init_worker` right *after* `load_general_plugins()`) reads
   `cpu_triton_utils._expand_kernel_impl` and registers it with `vllm.triton_utils.dispatcher`, which
   binds it into a `KernelOverride` that replaces `rejection_sampler.expand_kernel` and the `.kernel`
   of the `_expand` dispatcher. Patching the module attribute before that registration (the plugin
   runs first) is therefore what takes effect; if the override was already registered in this process
   (patches applied late), the fixed function is registered again through the dispatcher's public API.

2. `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only` (used on CPU for top-k without top-p)
   calls `k.max()`, which raises on an empty tensor. With speculation configured, the runner builds
   spec-decode metadata for every step (`GPUModelRunner._prepare_inputs`), so a step in which no
   request has draft tokens (the step that samples the first token after prefill, or one where the
   proposer proposed nothing) still runs `RejectionSampler.forward` ->
   `apply_sampling_constraints` -> `apply_top_k_top_p` -> `apply_top_k_only` with zero draft rows:
   any request with `top_k` kills the engine at its first step. Fix: with zero rows there is nothing
   to mask; return the logits unchanged, otherwise call the original. (`apply_top_k_only` is looked up
   as a module global at each call, so patching the module attribute is enough.)

3. `GPUModelRunner._bookkeeping_sync` (the CPU runner inherits it) undoes the random numbers a discarded
   sample consumed (a request whose prompt is prefilled in several chunks samples at each partial chunk)
   with `gen.set_offset(gen.get_offset() - 4)`: CUDA's Philox generators have an offset, CPU's Mersenne
   Twister raises "CPU Generator does not use offset". Any seeded request whose prompt is longer than what
   one step prefills (`max_num_batched_tokens`, or a busy batch) kills the CPU engine, with or without
   speculation. Fix: `sample_tokens` saves the state of those rows' generators before sampling, and
   `_bookkeeping_sync` puts it back (exactly "this step drew nothing for the row", which the offset
   arithmetic approximates on CUDA) and hides those generators from vLLM's rewind loop.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from saguaro_vllm.patches import vllm_patch

logger = logging.getLogger("vllm.saguaro.patches")

_CPU_TRITON_UTILS = "vllm.utils.cpu_triton_utils"
_TOPK_TOPP = "vllm.v1.sample.ops.topk_topp_sampler"
#: The dispatcher key under which the CPU platform registers the expand fallback.
EXPAND_KERNEL_KEY = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_at_dtype(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                    replace_from: Any, replace_to: Any, MAX_NUM_TOKENS: int | None = None) -> None:
    """What the Triton `expand_kernel` computes, at `output`'s dtype, written into `output`.

    Request i owns `output[cu[i-1]:cu[i]]` (`cu[-1]` read as 0) and gets `input_val[i]`, or
    `replace_to` where `input_val[i] == replace_from`; only its first `MAX_NUM_TOKENS` slots are
    written when that bound is given. Slots of no request are left untouched.

    >>> out = torch.zeros(6)
    >>> expand_at_dtype(out, torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 5, 6]), 0, 1)
    >>> out.tolist()
    [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    """
    if input_val.numel() == 0:
        return
    cu = cu_num_tokens.to(device=output.device, dtype=torch.int64)
    starts = torch.cat([cu.new_zeros(1), cu[:-1]])
    counts = (cu - starts).clamp_(min=0)
    values = torch.where(input_val == replace_from,
                         torch.as_tensor(replace_to, dtype=input_val.dtype, device=input_val.device),
                         input_val).to(device=output.device, dtype=output.dtype)
    # Requests own consecutive slots from 0: slot j belongs to request[j].
    request = torch.repeat_interleave(torch.arange(cu.numel(), device=output.device), counts)
    index = torch.arange(request.numel(), device=output.device)
    if MAX_NUM_TOKENS is not None:
        keep = index - starts[request] < MAX_NUM_TOKENS
        request, index = request[keep], index[keep]
    output[index] = values[request]


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _expand_bug_present() -> bool:
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:  # with Triton-CPU the Triton kernel runs itself
        return False
    from vllm.utils import cpu_triton_utils

    return "_ensure_int64(output)" in _source(cpu_triton_utils._expand_kernel_impl)


@vllm_patch(_CPU_TRITON_UTILS, "_expand_kernel_impl", when=_expand_bug_present,
            why="the CPU expand fallback leaves float32/int32 outputs uninitialised (vllm #55005): "
                "wrong temperature/top-k/top-p at draft positions, biased spec-decode sampling")
def patch_expand_kernel_impl(original: Any) -> Any:
    @functools.wraps(original)
    def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                            MAX_NUM_TOKENS=None):
        if output.dtype == torch.int64 and input_val.dtype == torch.int64:
            # No copy is made for int64 tensors: the C++ op writes into the real output.
            return original(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)
        expand_at_dtype(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)

    _rebind_if_registered(original, _expand_kernel_impl)
    return _expand_kernel_impl


def _rebind_if_registered(original: Any, fixed: Any) -> None:
    """If the CPU platform already registered `original` as the expand override, register `fixed`."""
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(EXPAND_KERNEL_KEY)
    if entry is not None and entry[1] is original:
        logger.info("saguaro-vllm: expand override was registered before the patch; re-registering")
        dispatcher.register_kernels({EXPAND_KERNEL_KEY: fixed})


def _top_k_bug_present() -> bool:
    """Checked by behaviour: does vLLM's `apply_top_k_only` fail on an empty batch?"""
    from vllm.v1.sample.ops import topk_topp_sampler

    try:
        topk_topp_sampler.apply_top_k_only(torch.empty(0, 4), torch.empty(0, dtype=torch.int32))
    except RuntimeError:
        return True
    return False


@vllm_patch(_TOPK_TOPP, "apply_top_k_only", when=_top_k_bug_present,
            why="k.max() raises on the empty batch the rejection sampler passes when a spec-decode "
                "step has no draft token: any top_k request crashes the engine")
def patch_apply_top_k_only(original: Any) -> Any:
    @functools.wraps(original)
    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    return apply_top_k_only


RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def _generator_rewind_bug_present() -> bool:
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not current_platform.is_cpu():
        return False
    if "gen.set_offset(gen.get_offset()" not in _source(GPUModelRunner._bookkeeping_sync):
        return False
    try:
        torch.Generator().get_offset()
    except RuntimeError:
        return True
    return False


def discarded_generator_states(runner: Any) -> dict[int, torch.Tensor]:
    """The generator state of every row whose sample this step will discard (a partial prefill)."""
    num_reqs = runner.input_batch.num_reqs
    gens = runner.input_batch.generators
    rows = runner.discard_request_mask.np[:num_reqs].nonzero()[0]
    return {int(i): gens[int(i)].get_state() for i in rows if int(i) in gens}


@vllm_patch(RUNNER, "sample_tokens", when=_generator_rewind_bug_present,
            why="save the CPU generators of rows whose sample is discarded (partial prefills), so that "
                "_bookkeeping_sync can rewind them without CUDA's generator offsets")
def wrap_sample_tokens(original: Any) -> Any:
    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        self._saguaro_rewind = discarded_generator_states(self) if self.execute_model_state is not None else {}
        try:
            return original(self, grammar_output)
        finally:
            self._saguaro_rewind = {}

    return sample_tokens


@vllm_patch(RUNNER, "_bookkeeping_sync", when=_generator_rewind_bug_present,
            why="gen.set_offset raises on CPU generators: every seeded request prefilled in several "
                "chunks crashes the CPU engine; the saved generator state is restored instead")
def wrap_bookkeeping_sync(original: Any) -> Any:
    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        gens = self.input_batch.generators
        hidden = {}
        for i, state in (getattr(self, "_saguaro_rewind", None) or {}).items():
            if i in gens:
                gens[i].set_state(state)
                hidden[i] = gens.pop(i)
        try:
            return original(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    return _bookkeeping_sync
