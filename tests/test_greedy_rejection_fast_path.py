"""The all-greedy verification fast path (`patches/greedy_rejection.py`) against vLLM's own rejection sampler.

- Exactness: on random batches over many shapes (batch 1-64, K 1-5, requests without drafts, accepted and
  rejected positions, ties, fp32 and bf16 logits, vocabulary 128256 once) the fast path returns the same
  output token ids as vLLM's unpatched `RejectionSampler.forward`.
- It runs only when the runner's drafter is a Saguaro proposer and the batch is all greedy with nothing
  else that vLLM applies to the target rows; otherwise vLLM's own `forward` (its `rejection_sample`) runs.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from saguaro_vllm.patches import apply_all, original_of
from saguaro_vllm.patches import greedy_rejection as gr


@pytest.fixture(scope="module", autouse=True)
def patched():
    apply_all()
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if current_platform.is_cpu() and not HAS_TRITON:  # what a CPU worker does before sampling
        current_platform.import_kernels()
        current_platform.register_triton_kernel_overrides()


def _sampler(saguaro=True, synthetic=False):
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    spec = None
    if synthetic:
        spec = types.SimpleNamespace(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5, 0.5])
    rs = RejectionSampler(Sampler(), spec, torch.device("cpu"))
    if saguaro:
        runner = types.SimpleNamespace(rejection_sampler=rs)
        gr.mark_saguaro(runner)
    return rs


def _sampling_metadata(batch, vocab, greedy=True, **overrides):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    zeros = torch.zeros(batch)
    temperature = None if greedy else torch.rand(batch) + 0.5
    md = SamplingMetadata(
        temperature=temperature, all_greedy=greedy, all_random=not greedy, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    return dataclasses.replace(md, **overrides)


def _batch(num_draft, vocab, gen, dtype=torch.float32, p_accept=0.7, ties=False):
    """Logits laid out as the runner lays them out (each request: its draft rows, then its bonus row), drafts
    that are the target's argmax with probability `p_accept` per position, and the spec-decode metadata."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    n_tok, batch = sum(num_draft), len(num_draft)
    rows = n_tok + batch
    if ties:  # few distinct values: many tied maxima, first index wins
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).to(dtype)
    else:
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    target_idx, bonus_idx, start = [], [], 0
    for n in num_draft:
        target_idx += range(start, start + n)
        bonus_idx.append(start + n)
        start += n + 1
    target_idx_t = torch.tensor(target_idx, dtype=torch.int32)
    argmax = logits.float().argmax(-1)[target_idx_t.long()] if n_tok else torch.empty(0, dtype=torch.long)
    rand = torch.randint(0, vocab, (n_tok,), generator=gen)
    accept = torch.rand(n_tok, generator=gen) < p_accept
    draft = torch.where(accept, argmax, rand).to(torch.int32)
    md = SpecDecodeMetadata(
        draft_token_ids=draft, num_draft_tokens=list(num_draft),
        cu_num_draft_tokens=torch.from_numpy(np.cumsum(num_draft, dtype=np.int32)),
        cu_num_sampled_tokens=torch.from_numpy(np.cumsum([n + 1 for n in num_draft], dtype=np.int32)),
        target_logits_indices=target_idx_t, bonus_logits_indices=torch.tensor(bonus_idx, dtype=torch.int32),
        logits_indices=torch.arange(rows, dtype=torch.int32))
    return md, logits


def _vllm(rs, md, logits, smd):
    return original_of("vllm.v1.sample.rejection_sampler:RejectionSampler", "forward")(
        rs, md, None, logits.clone(), smd)


def _shapes():
    rng = np.random.default_rng(0)
    out = []
    for batch in (1, 2, 3, 5, 8, 16, 31, 64):
        for k in (1, 2, 3, 5):
            for zero_frac in (0.0, 0.3):
                nd = [0 if rng.random() < zero_frac else k for _ in range(batch)]
                if rng.random() < 0.5:  # some requests with fewer drafts than K
                    nd = [int(rng.integers(0, k + 1)) if d else 0 for d in nd]
                if max(nd) == 0:
                    nd[0] = k
                out.append(nd)
    out += [[0], [0, 0, 0]]  # a step in which no request has drafts
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_equals_vllm_over_shapes(dtype):
    gen = torch.Generator().manual_seed(1)
    rs = _sampler()
    accepted = rejected = bonus = 0  # draft positions accepted / rejected, bonus tokens appended
    for i, nd in enumerate(_shapes()):
        for p_accept, ties in ((0.7, False), (1.0, False), (0.0, False), (0.8, True)):
            vocab = int(torch.randint(2, 300, (1,), generator=gen))
            md, logits = _batch(nd, vocab, gen, dtype, p_accept, ties)
            smd = _sampling_metadata(len(nd), vocab)
            assert gr.fast_path_applies(rs, logits, smd)
            want = _vllm(rs, md, logits, smd).sampled_token_ids
            got = rs(md, None, logits.clone(), smd)
            assert got.logprobs_tensors is None
            assert got.sampled_token_ids.dtype == want.dtype and torch.equal(got.sampled_token_ids, want), (nd, i)
            for r, n in enumerate(nd):
                kept = int((want[r] != -1).sum())  # accepted drafts + (bonus or the first rejected position)
                full = kept == n + 1
                bonus += full
                accepted += n if full else kept - 1
                rejected += 0 if full else 1
    assert accepted > 100 and rejected > 100 and bonus > 100  # both outcomes were exercised


def test_fast_path_equals_vllm_at_real_vocabulary():
    gen = torch.Generator().manual_seed(2)
    rs = _sampler()
    nd = [5, 0, 5, 3, 5, 1, 5, 5]
    md, logits = _batch(nd, 128256, gen, torch.float32, p_accept=0.8)
    smd = _sampling_metadata(len(nd), 128256)
    want = _vllm(rs, md, logits, smd).sampled_token_ids
    assert torch.equal(rs(md, None, logits, smd).sampled_token_ids, want)


@pytest.fixture
def spy(monkeypatch):
    """Counts of vLLM's `rejection_sample` (its forward ran) and of the fast path."""
    from vllm.v1.sample import rejection_sampler as rsm

    calls = {"vllm": 0, "fast": 0}
    vllm_rs, fast = rsm.rejection_sample, gr.greedy_forward

    def counting_vllm(*a, **kw):
        calls["vllm"] += 1
        return vllm_rs(*a, **kw)

    def counting_fast(*a, **kw):
        calls["fast"] += 1
        return fast(*a, **kw)

    monkeypatch.setattr(rsm, "rejection_sample", counting_vllm)
    monkeypatch.setattr(gr, "greedy_forward", counting_fast)
    return calls


def test_taken_when_all_greedy(spy):
    gen = torch.Generator().manual_seed(3)
    md, logits = _batch([3, 0, 2], 50, gen)
    rs_out = _sampler()(md, None, logits, _sampling_metadata(3, 50))
    assert spy == {"vllm": 0, "fast": 1} and rs_out.sampled_token_ids.shape == (3, 4)


def _min_tokens_processor():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    proc = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    proc.min_toks = {0: (5, [], {1}, False)}
    return LogitsProcessors([proc]) if not proc.is_argmax_invariant() else None


class _Holder:
    def has_tracked_requests(self):
        return True

    def apply_to_logits(self, logits, **kw):
        return logits


@pytest.mark.parametrize("case", ["not_saguaro", "sampled", "mixed", "synthetic", "logprobs", "logprobs_0",
                                  "logprob_token_ids", "penalties", "allowed_ids", "bad_words", "min_tokens",
                                  "thinking_budget", "fp64"])
def test_vllm_path_runs_otherwise(spy, case):
    gen = torch.Generator().manual_seed(4)
    batch, vocab = 3, 50
    md, logits = _batch([3, 0, 2], vocab, gen, torch.float64 if case == "fp64" else torch.float32)
    rs = _sampler(saguaro=case != "not_saguaro", synthetic=case == "synthetic")
    smd = _sampling_metadata(batch, vocab, greedy=case != "sampled")
    if case == "mixed":
        smd = dataclasses.replace(smd, all_greedy=False, all_random=False,
                                  temperature=torch.tensor([0.0, 1.0, 0.0]))
    elif case == "logprobs":
        smd = dataclasses.replace(smd, max_num_logprobs=3)
    elif case == "logprobs_0":
        smd = dataclasses.replace(smd, max_num_logprobs=0)
    elif case == "logprob_token_ids":
        smd = dataclasses.replace(smd, logprob_token_ids={0: [1, 2]})
    elif case == "penalties":
        smd = dataclasses.replace(smd, no_penalties=False, repetition_penalties=torch.full((batch,), 1.3),
                                  prompt_token_ids=torch.randint(0, vocab, (batch, 4), generator=gen),
                                  spec_token_ids=[[1, 2, 3], [], [4, 5]])
    elif case == "allowed_ids":
        smd = dataclasses.replace(smd, allowed_token_ids_mask=torch.zeros(batch, vocab, dtype=torch.bool))
    elif case == "bad_words":
        smd = dataclasses.replace(smd, bad_words_token_ids={0: [[7]]}, spec_token_ids=[[1, 2, 3], [], [4, 5]])
    elif case == "min_tokens":
        procs = _min_tokens_processor()
        assert procs is not None and procs.non_argmax_invariant
        smd = dataclasses.replace(smd, logitsprocs=procs)
    elif case == "thinking_budget":
        smd = dataclasses.replace(smd, thinking_budget_state_holder=_Holder())
    assert not gr.fast_path_applies(rs, logits, smd)
    if case in ("min_tokens", "thinking_budget", "logprob_token_ids", "synthetic"):
        return  # the decision is what matters: stand-ins, or (synthetic) a mode vLLM's CPU kernels refuse
    rs(md, None, logits, smd)
    assert spy == {"vllm": 1, "fast": 0}


def test_inactive_min_tokens_processor_keeps_the_fast_path():
    """vLLM's builtin min-tokens processor is always loaded; only a request with min_tokens turns it on."""
    procs = _min_tokens_processor()
    procs.non_argmax_invariant[0].min_toks = {}
    smd = _sampling_metadata(2, 10, logitsprocs=procs)
    assert gr.fast_path_applies(_sampler(), torch.zeros(3, 10), smd)


def test_fly_verification_keeps_vllms_path():
    """vLLM 0.33's FLy verification (`rejection_sample_method: fly`, which sets the sampler's `fly_window_size`)
    rewrites the greedy rows' argmax from the target rows' entropy: such a sampler never takes the fast path.
    (vLLM 0.32's sampler has no FLy; the attribute is set here as 0.33's `RejectionSampler.__init__` sets it.)"""
    rs = _sampler()
    smd = _sampling_metadata(2, 10)
    assert gr.fast_path_applies(rs, torch.zeros(3, 10), smd)
    rs.fly_window_size = 2
    assert not gr.fast_path_applies(rs, torch.zeros(3, 10), smd)


def test_runner_marks_its_sampler_only_for_a_saguaro_drafter():
    """The propose wrapper marks the sampler; vLLM's own proposers never reach `mark_saguaro`."""
    import inspect

    from saguaro_vllm.patches import model_runner

    src = inspect.getsource(model_runner.wrap_propose_draft_token_ids)
    assert src.index("if drafter is None") < src.index("mark_saguaro(self)")
    assert not getattr(_sampler(saguaro=False), gr.MARK, False)
