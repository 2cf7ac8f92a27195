"""vLLM's own speculative-config keys next to `method: "saguaro"`: which are passed through, which refused.

A config ported from vLLM's `draft_model` method often carries vLLM keys. Each one gets a decision with its
reason, so that a key never does nothing silently and a refusal says what to use instead. Decided against
vLLM 0.32's and 0.33's `vllm/config/speculative.py` (`tests/test_config.py` checks that every field of the
installed vLLM is listed; the keys new in 0.33 are refused below):

- passed through to vLLM's `SpeculativeConfig` (they work with the `custom_class` hook Saguaro runs on):
  `PASSED_THROUGH`, each with the values that keep Saguaro exact;
- honoured by Saguaro itself: `max_model_len` (a `SaguaroConfig` field: longer contexts go unspeculated) and
  `revision` (the draft's hub revision, used when the front end downloads it);
- refused, with the reason and the fix: `REFUSED`.
"""
from __future__ import annotations

from typing import Any

#: key -> (allowed values, why only those). The value goes into vLLM's config unchanged.
PASSED_THROUGH: dict[str, tuple[tuple[Any, ...], str]] = {
    "rejection_sample_method": (
        ("standard",),
        "Saguaro's drafts are verified by vLLM's standard rejection sampler with the drafter's exact proposal "
        "probabilities; 'synthetic' accepts drafts at made-up rates and 'fly' (vLLM 0.33) accepts some the "
        "target would reject (outputs change), and 'block' needs vLLM's V2 model runner, which has no custom_class proposers",
    ),
    "draft_tensor_parallel_size": (
        (1,),
        "the drafter runs in one process on one device (saguaro.device); it has no tensor parallelism",
    ),
}

_MODEL_DRAFTERS = "applies to vLLM's built-in model drafters (EAGLE, MTP, draft_model), not to Saguaro's drafter"

#: key -> why it is refused and what to do instead.
REFUSED: dict[str, str] = {
    "tensor_parallel_size": "vLLM's misspelling guard for draft_tensor_parallel_size; the drafter runs on one "
    "device (saguaro.device): remove it",
    "num_speculative_tokens_per_batch_size": "vLLM hands the per-batch-size K only to its built-in proposers, "
    "never to a custom_class proposer such as Saguaro's, so it would do nothing; remove it (mode 'async' sizes "
    "its pre-drafting per batch by itself)",
    "quantization": "the drafter loads unquantized safetensors in its own runtime; remove it (for a faster "
    "draft on CPU set saguaro.linear to 'int8')",
    "kv_cache_dtype": "the drafter's KV cache has the draft's dtype; set saguaro.dtype instead",
    "enforce_eager": "the drafter never uses CUDA graphs, so it would do nothing; remove it",
    "code_revision": "the drafter runs its own Llama/Qwen3 code, never remote code; remove it",
    "draft_sample_method": "Saguaro drafts greedily for greedy requests and samples with the request's own "
    "temperature/top-k/top-p otherwise, always sending the exact probabilities; remove it",
    "prompt_lookup_max": "belongs to vLLM's ngram method; with Saguaro use saguaro.backup 'ngram' (mode 'async')",
    "prompt_lookup_min": "belongs to vLLM's ngram method; with Saguaro use saguaro.backup 'ngram' (mode 'async')",
    "use_heterogeneous_vocab": "Saguaro needs a draft with the target's vocabulary; remove it and use such a "
    "draft",
    "attention_backend": "the drafter has its own attention kernels (docs/dev/ops.md); remove it",
    "moe_backend": "the drafter runs dense Llama/Qwen3 drafts only; remove it",
    "draft_load_config": "the drafter loads the draft's safetensors itself; remove it",
    "synthetic_acceptance_rates": "synthetic rejection sampling accepts drafts at made-up rates, which changes "
    "outputs; Saguaro keeps outputs exact: remove it",
    "synthetic_acceptance_length": "synthetic rejection sampling accepts drafts at made-up rates, which changes "
    "outputs; Saguaro keeps outputs exact: remove it",
    "enable_adaptive_verification": "vLLM supports it for method 'dspark' only; remove it",
    "dspark_draft_topk": "belongs to method 'dspark'; remove it",
    "index_share_for_mtp_iteration": "belongs to MTP drafters; remove it",
    "disable_padded_drafter_batch": f"{_MODEL_DRAFTERS} (EAGLE only); remove it",
    "disable_eagle_block_drop": f"{_MODEL_DRAFTERS} (EAGLE only); remove it",
    "use_local_argmax_reduction": f"{_MODEL_DRAFTERS}; remove it",
    "parallel_drafting": f"{_MODEL_DRAFTERS}; remove it",
    "suffix_decoding_max_tree_depth": "belongs to vLLM's suffix method; remove it",
    "suffix_decoding_max_cached_requests": "belongs to vLLM's suffix method; remove it",
    "suffix_decoding_max_spec_factor": "belongs to vLLM's suffix method; remove it",
    "suffix_decoding_min_token_prob": "belongs to vLLM's suffix method; remove it",
    "target_model_config": "set by vLLM itself; remove it",
    "target_parallel_config": "set by vLLM itself; remove it",
    "draft_model_config": "set by vLLM itself; remove it",
    "draft_parallel_config": "set by vLLM itself; remove it",
    # New in vLLM 0.33.
    "disable_lookahead_block_hashes": f"{_MODEL_DRAFTERS} (EAGLE-like methods); remove it",
    "draft_lm_head_quantization": f"{_MODEL_DRAFTERS} (EAGLE and MTP, Model Runner V2 only); remove it",
    "xpress_topc": "belongs to vLLM's XPress drafting; remove it",
    "fly_window_size": "FLy verification accepts drafts the target would reject (outputs change); Saguaro keeps "
    "outputs exact: remove it",
    "fly_entropy_threshold": "FLy verification accepts drafts the target would reject (outputs change); Saguaro "
    "keeps outputs exact: remove it",
    "fly_entropy_top_k": "FLy verification accepts drafts the target would reject (outputs change); Saguaro keeps "
    "outputs exact: remove it",
}

#: Keys of `REFUSED` that only vLLM 0.33 has (an older vLLM rejects them itself, as unknown keys).
NEW_IN_0_33 = ("disable_lookahead_block_hashes", "draft_lm_head_quantization", "xpress_topc", "fly_window_size",
               "fly_entropy_threshold", "fly_entropy_top_k")

#: Handled as `SaguaroConfig` fields (method, model, K; max_model_len is honoured by the drafter, revision by
#: the front end's download of the draft).
SAGUARO_FIELDS = ("method", "model", "num_speculative_tokens", "max_model_len", "revision")


def split_vllm_keys(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the Saguaro keys, the vLLM keys to pass through, one error line per refused key or value)."""
    saguaro, passed, errors = {}, {}, []
    for key, value in data.items():
        if key in PASSED_THROUGH:
            allowed, why = PASSED_THROUGH[key]
            if value in allowed and type(value) is type(allowed[0]):
                passed[key] = value
            else:
                shown = " or ".join(repr(a) for a in allowed)
                errors.append(f"speculative_config.{key}: only {shown} works with method 'saguaro' (got "
                              f"{value!r}): {why}.")
        elif key in REFUSED:
            errors.append(f"speculative_config.{key}: vLLM's key is not supported with method 'saguaro': "
                          f"{REFUSED[key]}.")
        else:
            saguaro[key] = value
    return saguaro, passed, errors
