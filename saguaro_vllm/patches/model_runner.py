"""Give the Saguaro proposer what vLLM's `custom_class` hook does not pass it.

- before each `propose`: the runner itself (request ids of each row, sampling params), so outcomes are keyed
  by the real request id;
- after it: the exact proposal probabilities of sampled drafts, handed to the rejection sampler through the
  runner's own draft-probability slot (`_draft_probs`, as vLLM's built-in model drafters do);
- finished requests, so the drafter frees their state at once (also when the engine goes idle).
Every wrapper is a no-op unless the runner's drafter is a Saguaro proposer.
"""
from __future__ import annotations

import functools

from saguaro_vllm.patches import vllm_patch

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"


def _saguaro_drafter(runner):
    drafter = getattr(runner, "drafter", None)
    return drafter if getattr(drafter, "is_saguaro_proposer", False) else None


@vllm_patch(RUNNER, "propose_draft_token_ids",
            why="pass request ids to the Saguaro proposer and exact draft probabilities to the sampler")
def wrap_propose_draft_token_ids(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        drafter = _saguaro_drafter(self)
        if drafter is None:
            return original(self, *args, **kwargs)
        drafter.bind_runner(self)
        draft_token_ids = original(self, *args, **kwargs)
        probs = drafter.take_last_draft_probs()
        if probs is not None:  # rows in the proposer's order (sampled rows first), each with its request
            self._draft_probs = probs
            self._draft_prob_req_ids = drafter.take_last_draft_prob_req_ids()
        return draft_token_ids

    return propose_draft_token_ids


@vllm_patch(RUNNER, "_update_states", why="tell the drafter which requests finished")
def wrap_update_states(original):
    @functools.wraps(original)
    def _update_states(self, scheduler_output):
        drafter = _saguaro_drafter(self)
        if drafter is not None and scheduler_output.finished_req_ids:
            drafter.on_requests_finished(scheduler_output.finished_req_ids)
            if not scheduler_output.total_num_scheduled_tokens:  # no propose this step: tell the drafter now
                drafter.flush_finished()
        return original(self, scheduler_output)

    return _update_states
