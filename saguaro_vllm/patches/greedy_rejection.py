"""All-greedy verification without vLLM's two `[tokens, vocab]` copies of the target logits.

vLLM 0.32's `RejectionSampler.forward` (vllm/v1/sample/rejection_sampler.py) builds the target rows of the
draft positions as
    raw_target_logits = logits[target_logits_indices]          # copy 1: advanced indexing
    raw_target_logits = raw_target_logits.to(torch.float32)     # no copy when already fp32
    target_logits = target_logits.clone()                       # copy 2 (unless a processed logprobs mode)
then `apply_logits_processors` and `apply_sampling_constraints` (which returns its input when `all_greedy`),
and `rejection_sample`, which for an all-greedy batch only takes `target_logits.argmax(dim=-1)` and runs
`_rejection_greedy_sample` (no random numbers outside synthetic mode). At vocabulary 128256, batch 16, K=5
the two copies are 2 x 41 MB per step, about 45 of the sampler's ~60 ms on one core here.

When the runner's drafter is a Saguaro proposer (the runner marks its rejection sampler, `mark_saguaro`) and
the batch is one in which that argmax is all vLLM's path uses of the target rows, `forward` below computes
`logits.argmax(dim=-1)[target_logits_indices]` instead (the argmax of each row is the same whichever tensor
holds the row; fp16/bf16 -> fp32 is exact, so the argmax of the fp32 copy is the argmax of the row), and
runs the same bonus-token sampler call and the same `_rejection_greedy_sample` kernel as vLLM.
The batch qualifies (`fast_path_applies`) only when every part of vLLM's path that could change the target
rows, or that needs more than the output tokens, is off:
- `all_greedy` (no sampled request: temperature, top-k/top-p, recovered tokens, random numbers);
- not synthetic rejection (`rejection_sample_method: synthetic` draws uniforms even when greedy);
- not FLy rejection (vLLM 0.33, `rejection_sample_method: fly`, sets `fly_window_size` on the sampler): its
  `apply_fly_greedy_acceptance_kernel` rewrites the target argmax from the target rows' entropy before
  `_rejection_greedy_sample`, so greedy rows need more than the argmax (docs/dev/vllm-compat.md);
- no logprobs (`max_num_logprobs is None`: vLLM returns logprobs built from the copied rows; nor
  `logprob_token_ids`, which vLLM's path would ignore here, kept out to stay on the plainest case);
- `no_penalties`, no `allowed_token_ids_mask`, no bad words (`apply_logits_processors` applies these);
- no min-tokens request (the one non-argmax-invariant logits processor vLLM applies at draft positions:
  `MinTokensLogitsProcessor.apply_with_spec_decode`, a no-op without `min_toks`);
- no thinking-budget request (`thinking_budget_state_holder.has_tracked_requests()`);
- logits of dtype float32, float16 or bfloat16 (others would be rounded by vLLM's `.to(float32)`).
Anything else, and any other drafter, runs vLLM's own `forward`.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from saguaro_vllm.patches import SHORTCUT_STEPS, vllm_patch

SAMPLER = "vllm.v1.sample.rejection_sampler:RejectionSampler"
#: Attribute the runner sets on its rejection sampler when its drafter is a Saguaro proposer.
MARK = "_saguaro_drafter"
_EXACT_TO_FP32 = (torch.float32, torch.float16, torch.bfloat16)
logger = logging.getLogger("vllm.saguaro.patches")
_said = False


def mark_saguaro(runner: Any) -> None:
    """Let the runner's rejection sampler take the fast path (the runner's drafter is a Saguaro proposer)."""
    sampler = getattr(runner, "rejection_sampler", None)
    if sampler is not None and not getattr(sampler, MARK, False):
        setattr(sampler, MARK, True)


def fast_path_applies(sampler: Any, logits: torch.Tensor, sampling_metadata: Any) -> bool:
    """Whether vLLM's path uses nothing of the target rows but their argmax (see the module docstring)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    md = sampling_metadata
    if not getattr(sampler, MARK, False) or not md.all_greedy or sampler.synthetic_mode:
        return False
    if getattr(sampler, "fly_window_size", None) is not None:  # vLLM 0.33's FLy verification (not in 0.32)
        return False
    if md.max_num_logprobs is not None or not md.no_penalties or md.allowed_token_ids_mask is not None:
        return False
    if md.logprob_token_ids or md.bad_words_token_ids or logits.dtype not in _EXACT_TO_FP32:
        return False
    for processor in md.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks:
            return False
    holder = md.thinking_budget_state_holder
    return holder is None or not holder.has_tracked_requests()


def greedy_forward(sampler: Any, metadata: Any, logits: torch.Tensor, sampling_metadata: Any):
    """vLLM's `RejectionSampler.forward` for a batch `fast_path_applies` to, without the target-row copies."""
    from dataclasses import replace

    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample import rejection_sampler as rs

    assert metadata.max_spec_len <= rs.MAX_SPEC_LEN
    # The bonus tokens exactly as vLLM samples them (a [batch, vocab] copy, left as it is).
    bonus_sampler_output = sampler.sampler(
        logits=logits[metadata.bonus_logits_indices],
        sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
        predict_bonus_token=True,
        logprobs_mode_override="processed_logits" if sampler.is_processed_logprobs_mode else "raw_logits",
    )
    bonus_token_ids = bonus_sampler_output.sampled_token_ids
    # What `rejection_sample` computes for an all-greedy batch, with the argmax read in place.
    draft_token_ids = metadata.draft_token_ids
    assert draft_token_ids.ndim == 1 and draft_token_ids.is_contiguous() and bonus_token_ids.is_contiguous()
    target_argmax = logits.argmax(dim=-1)[metadata.target_logits_indices]
    assert target_argmax.shape == draft_token_ids.shape
    output_token_ids = torch.full((len(metadata.num_draft_tokens), metadata.max_spec_len + 1),
                                  rs.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=logits.device)
    rs._rejection_greedy_sample(output_token_ids, metadata.cu_num_draft_tokens, draft_token_ids, target_argmax,
                                bonus_token_ids, None, metadata.max_spec_len, None, None)
    return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)


@vllm_patch(SAMPLER, "forward",
            why="all-greedy batches with a Saguaro drafter: verify with the argmax of the target rows read in "
                "place, without vLLM's two [tokens, vocab] copies of them (indexing, then clone)")
def wrap_forward(original):
    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        if logits is not None and fast_path_applies(self, logits, sampling_metadata):
            global _said
            if not _said:
                _said = True
                logger.info("saguaro-vllm: all-greedy batches are verified without copying the target rows")
            SHORTCUT_STEPS["greedy_rejection"] += 1
            return greedy_forward(self, metadata, logits, sampling_metadata)
        return original(self, metadata, draft_probs, logits, sampling_metadata)

    return forward
