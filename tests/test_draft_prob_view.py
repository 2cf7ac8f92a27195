"""What the rejection sampler reads of the proposer's draft probabilities.

- Without vLLM's per-step copy (`patches/model_runner.py`, `aligned_draft_probs`): whenever the view is taken
  it holds exactly what vLLM's own `_get_spec_decode_draft_probs` builds; whenever the layout differs, vLLM's
  own function runs.
- Rows of requests the target decodes greedily are never read (so `assemble` leaves them as they are): vLLM's
  rejection sampler gives the same tokens whatever those rows hold.
"""
from __future__ import annotations

import itertools
import types

import pytest
import torch

from saguaro_vllm.patches import apply_all, original_of
from saguaro_vllm.patches.model_runner import RUNNER, aligned_draft_probs


def _runner(probs, prob_req_ids, batch_req_ids, saguaro=True):
    drafter = types.SimpleNamespace(is_saguaro_proposer=saguaro)
    return types.SimpleNamespace(_draft_probs=probs, _draft_prob_req_ids=prob_req_ids, drafter=drafter,
                                 input_batch=types.SimpleNamespace(req_ids=batch_req_ids))


def _vllm(runner, num_draft_tokens):
    return original_of(RUNNER, "_get_spec_decode_draft_probs")(
        runner, types.SimpleNamespace(num_draft_tokens=num_draft_tokens))


def _patched(runner, num_draft_tokens):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner._get_spec_decode_draft_probs(runner, types.SimpleNamespace(
        num_draft_tokens=num_draft_tokens))


@pytest.fixture(scope="module", autouse=True)
def patched():
    apply_all()


def test_aligned_rows_are_a_view_equal_to_vllms_copy():
    k, vocab = 3, 11
    probs = torch.rand(6, k, vocab)  # a slot of 6 rows, 4 used
    ids = ["a", "b", "c", "d"]
    batch = ["a", "x", "b", "c", "d"]  # "x": no drafts this step
    nd = [k, 0, k, k, k]
    view = aligned_draft_probs(probs, ids, batch, nd)
    assert view is not None and view.data_ptr() == probs.data_ptr() and view.is_contiguous()
    expected = _vllm(_runner(probs, ids, batch), nd)
    assert view.shape == expected.shape == (4 * k, vocab) and torch.equal(view, expected)
    got = _patched(_runner(probs, ids, batch), nd)
    assert got.data_ptr() == probs.data_ptr() and torch.equal(got, expected)


@pytest.mark.parametrize("case", ["order", "fewer", "missing", "extra_row_first", "none_drafted", "not_saguaro",
                                  "strided"])
def test_other_layouts_take_vllms_own_copy(case):
    k, vocab = 3, 7
    probs = torch.rand(5, k, vocab)
    ids, batch, nd, saguaro = ["a", "b", "c"], ["a", "b", "c"], [k, k, k], True
    if case == "order":
        batch = ["b", "a", "c"]
    elif case == "fewer":  # the scheduler trimmed a request's drafts
        nd = [k, k - 1, k]
    elif case == "missing":  # vLLM's own function warns and returns None
        ids = ["a", "c"]
    elif case == "extra_row_first":  # the slot's first row belongs to a request no longer in the batch
        ids = ["z", "a", "b", "c"]
    elif case == "none_drafted":
        nd = [0, 0, 0]
    elif case == "not_saguaro":
        saguaro = False
    elif case == "strided":
        probs = torch.rand(5, k + 1, vocab)[:, :k]
    if case != "not_saguaro":
        assert aligned_draft_probs(probs, ids, batch, nd) is None
    expected = _vllm(_runner(probs, ids, batch, saguaro), nd)
    got = _patched(_runner(probs, ids, batch, saguaro), nd)
    if expected is None:
        assert got is None
    else:
        assert got.data_ptr() != probs.data_ptr() and torch.equal(got, expected)


def test_every_small_layout_equals_vllms_result():
    """Exhaustive over small batches: the patched function returns vLLM's tensor (or None) in every layout."""
    k, vocab = 2, 5
    probs = torch.rand(3, k, vocab)
    for n_batch in range(1, 4):
        for nd in itertools.product(range(k + 1), repeat=n_batch):
            batch = [f"r{i}" for i in range(n_batch)]
            for ids in (batch, batch[::-1], [b for b, d in zip(batch, nd) if d]):
                expected = _vllm(_runner(probs, ids, batch), list(nd))
                got = _patched(_runner(probs, ids, batch), list(nd))
                assert (got is None) == (expected is None)
                if got is not None:
                    assert torch.equal(got, expected)


def test_greedy_requests_q_is_never_read():
    """vLLM's own rejection sampler (the CPU kernels a worker registers) on batches mixing greedy and sampled
    requests: the greedy requests' q rows one-hot, random, zero or NaN give the same output tokens, with the
    same random numbers. The sampled requests' q does matter (the check has power)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, rejection_sample

    if not current_platform.is_cpu() or HAS_TRITON:
        pytest.skip("checks the CPU build's kernels (the Triton kernels skip greedy rows the same way)")
    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()
    vocab, k = 40, 3
    temp = torch.tensor([1.0, 0.0, 0.7, 0.0, 1.3])
    nd = [k, k, 2, 1, k]
    cu = torch.tensor(nd).cumsum(0)
    row_of = torch.repeat_interleave(torch.arange(len(nd)), torch.tensor(nd))
    greedy_tok = (temp == 0)[row_of]
    gen = torch.Generator().manual_seed(0)

    def run(logits, q, draft, bonus, seed):
        zeros = torch.zeros(len(nd))
        meta = SamplingMetadata(
            temperature=temp.clone(), all_greedy=False, all_random=False, top_p=None, top_k=None, generators={},
            max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
            presence_penalties=zeros, repetition_penalties=torch.ones(len(nd)),
            output_token_ids=[[] for _ in nd], allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors())
        target = apply_sampling_constraints(logits.clone(), cu, meta)
        torch.manual_seed(seed)
        return rejection_sample(draft.clone(), nd, k, cu, q.contiguous(), target, bonus.clone(), meta)

    sampled_matter = 0
    for trial in range(100):
        n = sum(nd)
        logits = torch.randn(n, vocab, generator=gen) * 2
        q = torch.softmax(torch.randn(n, vocab, generator=gen), -1)
        draft = torch.multinomial(q, 1, generator=gen).squeeze(-1)
        bonus = torch.randint(0, vocab, (len(nd), 1), generator=gen)
        onehot = q.clone()
        onehot[greedy_tok] = 0
        onehot[greedy_tok.nonzero().squeeze(-1), draft[greedy_tok]] = 1
        want = run(logits, onehot, draft, bonus, trial)
        for fill in (torch.rand(int(greedy_tok.sum()), vocab, generator=gen), 0.0, float("nan")):
            other = onehot.clone()
            other[greedy_tok] = fill
            assert torch.equal(run(logits, other, draft, bonus, trial), want), trial
        flat = onehot.clone()
        flat[~greedy_tok] = 1.0 / vocab  # another q for the sampled requests' drafts
        sampled_matter += not torch.equal(run(logits, flat, draft, bonus, trial), want)
    assert sampled_matter > 10
