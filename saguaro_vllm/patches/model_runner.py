"""Give the Saguaro proposer what vLLM's `custom_class` hook does not pass it.

- before each `propose`: the runner itself (request ids of each row, sampling params), so outcomes are keyed
  by the real request id;
- after it: the exact proposal probabilities of sampled drafts, handed to the rejection sampler through the
  runner's own draft-probability slot (`_draft_probs`, as vLLM's built-in model drafters do);
- finished requests, so the drafter frees their state at once (also when the engine goes idle);
- in the next step's sampling, those probabilities without vLLM's copy when they are already laid out the way
  the rejection sampler reads them (`aligned_draft_probs`);
- its rejection sampler is marked as a Saguaro one, so that all-greedy batches are verified without vLLM's
  copies of the target rows (`greedy_rejection.py`).
Every wrapper is a no-op unless the runner's drafter is a Saguaro proposer.
"""
from __future__ import annotations

import functools

from saguaro_vllm.patches import SHORTCUT_STEPS, vllm_patch
from saguaro_vllm.patches.greedy_rejection import mark_saguaro

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
        mark_saguaro(self)  # all-greedy verification may skip vLLM's copies of the target rows
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


def aligned_draft_probs(probs, prob_req_ids, req_ids, num_draft_tokens):
    """What vLLM's `_get_spec_decode_draft_probs` returns, as a view of `probs` instead of a copy, or None.

    vLLM concatenates `probs[row of request, :num_draft]` for each request of the batch with drafts, in batch
    order, into a new contiguous `[tokens, vocab]` tensor: one full copy of the step's q per step (41 MB at
    batch 16, K=5, vocabulary 128256; 164 MB at batch 64; ~14 / 58 ms of the target's core here). When those
    rows are the first n rows of `probs` in the same order and each request has all K drafts scheduled, that
    concatenation is exactly `probs[:n]` seen as `[n * K, vocab]`: the same floats, in place. The proposer's
    tensor is the held ring slot (or its copy on the target's device), which nobody writes until the
    proposer's next `propose`, after this sampling, and the rejection sampler only reads it. None whenever
    the layout differs (rows in another order, a request with fewer drafts, a request missing): vLLM's own
    copy (or its fallback) runs then.
    """
    if probs is None or prob_req_ids is None or probs.dim() != 3 or not probs.is_contiguous():
        return None
    k, n = probs.shape[1], 0
    for req_id, num_draft in zip(req_ids, num_draft_tokens):
        if num_draft == 0:
            continue
        if num_draft != k or n >= len(prob_req_ids) or prob_req_ids[n] != req_id:
            return None
        n += 1
    return probs[:n].view(n * k, probs.shape[2]) if n else None


@vllm_patch(RUNNER, "_get_spec_decode_draft_probs",
            why="hand the rejection sampler the Saguaro proposer's probabilities without vLLM's per-step copy "
                "of [tokens, vocab] when they are already in the layout it builds")
def wrap_get_spec_decode_draft_probs(original):
    @functools.wraps(original)
    def _get_spec_decode_draft_probs(self, spec_decode_metadata):
        if _saguaro_drafter(self) is not None:
            view = aligned_draft_probs(self._draft_probs, self._draft_prob_req_ids, self.input_batch.req_ids,
                                       spec_decode_metadata.num_draft_tokens)
            if view is not None:
                SHORTCUT_STEPS["draft_probs_view"] += 1
                return view
        return original(self, spec_decode_metadata)

    return _get_spec_decode_draft_probs
