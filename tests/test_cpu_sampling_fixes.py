"""The CPU-build bugs of vLLM 0.32 that break speculative sampling or seeded requests, and our fixes
(`saguaro_vllm/patches/cpu_sampling.py`).

Unit tests compare the fixed expand with a plain-loop reference and run vLLM's own sampling functions;
engine tests run vLLM's built-in `draft_model` method at temperature 1.0 and compare its output
distribution with plain (non-speculative) vLLM: three engine start-ups; one more runs seeded requests whose
prompts are prefilled in several chunks.
"""
from __future__ import annotations

import pytest
import torch

from saguaro_vllm.patches import apply_all, original_of
from distribution import BIASED_P, EXACT_P

CPU_TL = "vllm.utils.cpu_triton_utils"
TOPK = "vllm.v1.sample.ops.topk_topp_sampler"
NUM_SAMPLES = 3000
TOP_K = 5
#: The shared thresholds (distribution.py says why): the smallest p-value a correct sampler may show, and
#: the largest at which the known bias counts as detected (measured: 1e-130 and below).
P_PASS = EXACT_P
P_BIASED = BIASED_P


@pytest.fixture(scope="module")
def vllm_cpu():
    """The patches applied in this process, and the CPU kernel overrides registered as a worker does."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cpu() or HAS_TRITON:
        pytest.skip("the buggy fallbacks are used only on CPU without Triton-CPU")
    current_platform.import_kernels()  # torch.ops._C.*, as every worker does
    apply_all()
    current_platform.register_triton_kernel_overrides()
    return current_platform


# ------------------------------------------------------------------------------------- unit tests

def loop_expand(output, input_val, cu_num_tokens, replace_from, replace_to, max_num_tokens=None):
    """Plain-Python statement of the Triton `expand_kernel`."""
    start = 0
    for i, end in enumerate(cu_num_tokens.tolist()):
        value = input_val[i].item()
        value = replace_to if value == replace_from else value
        for offset in range(end - start):
            if max_num_tokens is None or offset < max_num_tokens:
                output[start + offset] = value
        start = end


def _expand_case(dtype, counts, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        values = torch.rand(2 * len(counts), generator=gen, dtype=dtype)[::2]  # strided input
        values[::3] = 0.0  # some rows hit replace_from
    else:
        values = torch.randint(1, 50, (len(counts),), generator=gen, dtype=dtype)
        values[::3] = 0
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return values, cu


COUNTS = [[3], [2, 0, 3], [1] * 19, [0, 0], [4, 1, 0, 2, 3, 1, 1]]
DTYPES = [torch.float32, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: f"b{len(c)}-n{sum(c)}")
@pytest.mark.parametrize("replace", [(0, 1), (0, 0), (7, 9)])
def test_fixed_expand_matches_reference(vllm_cpu, dtype, counts, replace):
    from vllm.utils import cpu_triton_utils

    values, cu = _expand_case(dtype, counts, seed=len(counts))
    sentinel = -5
    expected = torch.full((sum(counts) + 2,), sentinel, dtype=dtype)  # 2 slots owned by no request
    loop_expand(expected, values, cu, *replace)
    out = torch.full_like(expected, sentinel)
    cpu_triton_utils._expand_kernel_impl(out, values, cu, *replace, MAX_NUM_TOKENS=128)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_expand_honours_max_num_tokens(vllm_cpu):
    from vllm.utils import cpu_triton_utils

    values, cu = _expand_case(torch.float32, [5, 1, 3], seed=0)
    expected = torch.full((9,), -1.0)
    loop_expand(expected, values, cu, 0, 1, max_num_tokens=2)
    out = torch.full((9,), -1.0)
    cpu_triton_utils._expand_kernel_impl(out, values, cu, 0, 1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=str)
def test_unpatched_expand_leaves_output_unwritten(vllm_cpu, dtype):
    """The bug itself: vLLM's CPU expand writes into an int64 copy, never into `output`."""
    values, cu = _expand_case(dtype, [2, 3], seed=1)
    out = torch.full((5,), -5, dtype=dtype)
    original_of(CPU_TL, "_expand_kernel_impl")(out, values, cu, 0, 1, 128)
    assert (out == -5).all()


def test_vllm_expand_dispatch_reaches_fix(vllm_cpu):
    """vLLM's own call path (`expand_batch_to_tokens` -> `_expand` dispatcher -> registered CPU
    override) expands temperatures and top-k values exactly, including 0.7 (not truncated to 0)."""
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from saguaro_vllm.patches.cpu_sampling import EXPAND_KERNEL_KEY

    assert dispatcher._registry[EXPAND_KERNEL_KEY][1] is not original_of(CPU_TL, "_expand_kernel_impl")
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    temperature = expand_batch_to_tokens(torch.tensor([0.7, 0.3, 0.0]), cu, 5, replace_from=0, replace_to=1)
    assert temperature.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])
    top_k = expand_batch_to_tokens(torch.tensor([3, 4, 24], dtype=torch.int32), cu, 5)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [3, 3, 24, 24, 24]


def test_fix_registered_late_is_rebound(vllm_cpu):
    """If the platform registered vLLM's expand before our patch, applying it re-registers the fix."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from saguaro_vllm.patches.cpu_sampling import EXPAND_KERNEL_KEY, _rebind_if_registered

    original, fixed = original_of(CPU_TL, "_expand_kernel_impl"), cpu_triton_utils._expand_kernel_impl
    try:
        dispatcher.register_kernels({EXPAND_KERNEL_KEY: original})
        _rebind_if_registered(original, fixed)
        assert dispatcher._registry[EXPAND_KERNEL_KEY][1] is fixed
        out = expand_batch_to_tokens(torch.tensor([0.7, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 3)
        assert out.tolist() == pytest.approx([0.7, 2.0, 2.0])
    finally:
        dispatcher.register_kernels({EXPAND_KERNEL_KEY: fixed})


def _sampling_metadata(temperature, top_k):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = temperature.shape[0]
    zeros = torch.zeros(n)
    return SamplingMetadata(
        temperature=temperature, all_greedy=False, all_random=True, top_p=None, top_k=top_k,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def test_top_k_without_drafts(vllm_cpu):
    """The rejection sampler constrains zero draft rows whenever no request of a step has drafts (the
    step that samples each request's first token): vLLM's own path crashes there, ours returns."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    meta = _sampling_metadata(torch.tensor([1.0, 0.5]), torch.tensor([5, 3], dtype=torch.int32))
    no_drafts = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="max"):
        original_of(TOPK, "apply_top_k_only")(torch.empty(0, 24), torch.empty(0, dtype=torch.int32))
    assert apply_sampling_constraints(torch.empty(0, 24), no_drafts, meta).shape == (0, 24)


def test_top_k_with_drafts_matches_reference(vllm_cpu):
    """Non-empty rows: per-draft-token temperature and top-k, checked against plain torch."""
    from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 24, generator=gen)
    temperature, top_k = torch.tensor([0.7, 2.0]), torch.tensor([5, 24], dtype=torch.int32)
    out = apply_sampling_constraints(logits.clone(), torch.tensor([2, 3], dtype=torch.int32),
                                     _sampling_metadata(temperature, top_k))
    expected = logits / torch.tensor([[0.7], [0.7], [2.0]])
    kth = expected[:2].topk(5, dim=1).values[:, -1:]
    expected[:2] = expected[:2].masked_fill(expected[:2] < kth, float("-inf"))
    torch.testing.assert_close(out, expected)


# ----------------------------------------------------------------------------------- engine tests

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from distribution import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("dist-models"))


def _spec_config(draft):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


VARIANTS = {"t1": {"temperature": 1.0}, "topk": {"temperature": 1.0, "top_k": TOP_K}}
#: vLLM without any saguaro-vllm plugin code (also in the engine's processes: they inherit it).
NO_PLUGINS = {"VLLM_PLUGINS": ""}


@pytest.fixture(scope="module")
def plain_run(models):
    from distribution import sample_outputs

    return sample_outputs(models[0], variants=VARIANTS, num_samples=NUM_SAMPLES, seed=1, env=NO_PLUGINS)


@pytest.fixture(scope="module")
def fixed_run(models):
    from distribution import sample_outputs

    return sample_outputs(models[0], speculative_config=_spec_config(models[1]), variants=VARIANTS,
                          num_samples=NUM_SAMPLES, seed=2)


def _fmt(pvalues):
    return ", ".join(f"{k}={v:.3g}" for k, v in pvalues.items())


@pytest.mark.engine
@pytest.mark.cpu_build_only  # the bias is a bug of vLLM's CPU build: a CUDA build samples exactly
def test_draft_model_biased_without_fix(models, plain_run):
    """vLLM's own `draft_model` on CPU at T=1.0, no plugin: the distribution test must fail."""
    from distribution import compare, sample_outputs

    run = sample_outputs(models[0], speculative_config=_spec_config(models[1]),
                         num_samples=NUM_SAMPLES, seed=3, env=NO_PLUGINS)
    assert run.spec.drafts > 0
    pvalues = compare(plain_run.tokens["t1"], run.tokens["t1"])
    print(f"without fix: {_fmt(pvalues)}; {run.spec}")
    assert max(pvalues.values()) < P_BIASED, f"bias not detected: {_fmt(pvalues)}"


@pytest.mark.engine
def test_draft_model_exact_with_fix(plain_run, fixed_run):
    from distribution import compare

    assert fixed_run.spec.drafts > 0 and fixed_run.spec.accepted > 0, fixed_run.spec
    assert fixed_run.spec.accepted < fixed_run.spec.draft_tokens  # rejections happened too
    pvalues = compare(plain_run.tokens["t1"], fixed_run.tokens["t1"])
    print(f"with fix: {_fmt(pvalues)}; {fixed_run.spec}")
    assert min(pvalues.values()) > P_PASS, _fmt(pvalues)


@pytest.mark.engine
def test_top_k_with_spec_decode_runs_and_is_exact(plain_run, fixed_run):
    """Requests with top_k ran to completion (the engine did not die) and sample the right law."""
    from distribution import compare

    spec, plain = fixed_run.tokens["topk"], plain_run.tokens["topk"]
    assert spec.shape == (NUM_SAMPLES, 5)
    # top-k is in force: at most TOP_K distinct first tokens, and second tokens per first token.
    assert len(set(spec[:, 0].tolist())) <= TOP_K
    assert all(len(set(spec[spec[:, 0] == t, 1].tolist())) <= TOP_K for t in set(spec[:, 0].tolist()))
    pvalues = compare(plain, spec)
    print(f"top_k={TOP_K} with fix: {_fmt(pvalues)}")
    assert min(pvalues.values()) > P_PASS, _fmt(pvalues)


@pytest.mark.engine
def test_seeded_request_prefilled_in_chunks(models):
    """vLLM rewinds the generator of a partial-prefill row with CUDA-only offsets: on CPU every seeded
    request longer than one step's token budget crashed the engine. With the fix the row's generator is
    restored, so the output cannot depend on how the prompt was chunked: each prompt runs cold (prefilled
    in 32-token chunks: 2 discarded samples each) and again warm (64 tokens from the prefix cache, the rest
    in one step),
    and both give the same tokens."""
    from engine_runs import Job, run_engine

    prompts = [[(7 * i + 3 * j + j // 5) % 23 + 1 for j in range(70 + 10 * i)] for i in range(3)]  # vocab 24
    params = [{"temperature": 1.0, "seed": 11 + i, "max_tokens": 12, "ignore_eos": True}
              for i in range(3)]
    runs = run_engine(models[0], [Job("cold", prompts, params, sequential=True),
                                  Job("warm", prompts, params, sequential=True)],
                      engine_kwargs={"max_model_len": 128, "max_num_batched_tokens": 32, "max_num_seqs": 4,
                                     "enable_chunked_prefill": True, "enable_prefix_caching": True,
                                     "skip_tokenizer_init": True, "block_size": 32})
    cold, warm = runs["cold"], runs["warm"]
    # warm skipped the chunks: the prompts' full 32-token blocks came from the cache (64 tokens of each)
    assert cold.prefix_cache_hits == 0 and warm.prefix_cache_hits == sum((len(p) - 1) // 32 * 32 for p in prompts)
    assert [len(t) for t in cold.token_ids] == [12] * 3
    assert cold.token_ids == warm.token_ids
