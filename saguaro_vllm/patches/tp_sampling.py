"""Tensor parallelism: TP rank 0's verification result is the one every rank keeps.

vLLM runs the sampler on every TP rank of the last pipeline stage (logits are all-gathered) and each rank
appends its own sampled tokens to its own copy of the batch; ranks agree only because their inputs and
RNG are identical. Saguaro's proposal probabilities q reach only rank 0 (the rank that talks to the
drafter), so at temperature > 0 the other ranks verify the same drafts as one-hot and can accept other
tokens: their KV shards then hold other tokens than rank 0's, silently.

Fix: after rejection sampling, rank 0's `sampled_token_ids` ([rows, K+1] int32) is broadcast over the TP
group and every rank continues with it. That is ~100 bytes per row per step, against `[tokens, vocab]`
float32 for broadcasting q itself (measured costs: benchmarks/notes.md). RNG stays in step:
every rank still draws the same noise, whatever q it verified with.

The broadcast is a collective, so whether it happens is decided from data every rank has: a Saguaro
drafter, TP > 1, draft tokens scheduled this step, and a batch that is not all greedy (greedy rows are
verified by argmax, the same on every rank). Pipeline parallelism needs nothing more: only the last
stage samples, and its TP group is the group used.

Each rank counts the steps it took rank 0's tokens in (`TP_RANK0_TOKEN_STEPS`: "sent" on rank 0, "received" on
the others), so that a test can tell which path every rank took.
"""
from __future__ import annotations

import functools
from typing import Any

from saguaro_vllm.patches import TP_RANK0_TOKEN_STEPS, vllm_patch

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def needs_rank0_tokens(runner: Any, spec_decode_metadata: Any, tp_world_size: int) -> bool:
    """Whether this step's sampled tokens must come from TP rank 0; the same answer on every rank."""
    if tp_world_size <= 1 or spec_decode_metadata is None:
        return False
    if not getattr(getattr(runner, "drafter", None), "is_saguaro_proposer", False):
        return False
    if spec_decode_metadata.draft_token_ids.numel() == 0:
        return False
    return not runner.input_batch.sampling_metadata.all_greedy


@vllm_patch(RUNNER, "_sample",
            why="TP > 1: only rank 0 has Saguaro's proposal probabilities, so rank 0's accepted tokens "
                "are broadcast to the other ranks, which would otherwise keep different tokens")
def wrap_sample(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        sampler_output = original(self, logits, spec_decode_metadata)
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        if needs_rank0_tokens(self, spec_decode_metadata, tp.world_size):
            tp.broadcast(sampler_output.sampled_token_ids, src=0)
            TP_RANK0_TOKEN_STEPS["sent" if tp.rank_in_group == 0 else "received"] += 1
        return sampler_output

    return _sample
