"""Statistical harness: is a speculative engine's output distribution the plain engine's?

Reusable by any test (not a test module itself). Typical use, one engine start-up per configuration:

    target, draft = build_tiny_pair(tmp_dir)
    plain = sample_outputs(target)
    spec = sample_outputs(target, speculative_config={"method": "draft_model", "model": str(draft),
                                                      "num_speculative_tokens": 3})
    pvalues = compare(plain.tokens["t1"], spec.tokens["t1"])      # {"pos2": p, ..., "joint2,3": p}
    assert min(pvalues.values()) > EXACT_P and spec.spec.accepted > 0

Why it has power: the models are tiny random Llamas with a 24-token vocabulary and a sharpened LM head,
so ~3000 samples fill a few dozen categories per output position and a biased sampler shows up as a
chi-square p-value many orders of magnitude below any threshold (vLLM's CPU expand bug: p < 1e-130).
The draft is the target with one layer fewer and a perturbed LM head: it agrees with the target often but
not always (vLLM `draft_model`, K=3: ~16 % of draft tokens accepted), so both the acceptance and the
recovery (rejection) paths of vLLM's rejection sampler decide the samples.

Each engine runs in a fresh Python process (`python tests/distribution.py REQUEST.json`) with the
environment the caller gives: vLLM general plugins run in every engine process at start-up, so this is
the only reliable way to compare an engine with the saguaro-vllm patches against one without
(`env={"VLLM_PLUGINS": ""}`) from one pytest process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: Thresholds shared by every distribution test. The suite computes about 40 chi-square p-values per run,
#: so a per-test pass threshold of 1e-3 would fail an exact sampler in about 4 % of runs (seen once:
#: p = 6e-4 on a path that gave 0.29 and 0.72 on reruns). 1e-4 brings that to about 0.4 %, while every
#: deliberately biased path tested here lands below BIASED_P = 1e-6 (vLLM's CPU expand bug: p ~ 1e-219).
EXACT_P = 1e-4
BIASED_P = 1e-6

#: Default prompt (token ids; the tiny models have no tokenizer).
PROMPT = (1, 7, 3, 12, 5)
#: Engine settings sized for a 2-core machine: 3000 samples of 5 tokens generate in 10-50 s.
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 256,
    "max_num_batched_tokens": 2048, "skip_tokenizer_init": True, "disable_log_stats": False,
    "enable_prefix_caching": True, "distributed_executor_backend": "uni",
}
#: One process for front end, engine core and worker (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni`
#: executor): a vLLM import costs ~15-35 s on a busy 2-core machine, three of them dominate a run.
#: The plugin still runs in the worker path (`init_worker` loads general plugins, then registers the
#: CPU kernel overrides). Pass `env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}` and
#: `engine_kwargs={"distributed_executor_backend": "mp"}` for vLLM's default process layout.
ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------------------------- models

def build_tiny_llama(path: Path, *, vocab_size: int = 24, num_layers: int = 2, hidden_size: int = 128,
                     num_heads: int = 2, seed: int = 0, lm_head_scale: float = 6.0,
                     like: Path | None = None, lm_head_noise: float = 0.0, max_positions: int = 128) -> Path:
    """Write a random-weight Llama (HF format, float32 safetensors) to `path`; returns `path`.

    `lm_head_scale` sharpens the next-token distribution (random init gives near-uniform logits).
    With `like`, start from that model's weights (keeping its first `num_layers` layers) and add
    Gaussian noise of std `lm_head_noise` * (the LM head's std) to the LM head: a correlated draft.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=vocab_size - 1, pad_token_id=None, torch_dtype="float32",
    )
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        if like is not None:
            source = LlamaForCausalLM.from_pretrained(like, torch_dtype=torch.float32)
            model.load_state_dict(source.state_dict(), strict=False)
            head = model.lm_head.weight
            head.add_(torch.randn(head.shape, generator=gen) * lm_head_noise * head.std())
        else:
            model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=gen)
            model.lm_head.weight.mul_(lm_head_scale)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def build_embedded_pair(root: Path, *, vocab_size: int, width: int, draft_hidden: int = 32, num_layers: int = 2,
                        seed: int = 0, lm_head_scale: float = 6.0, max_positions: int = 256) -> tuple[Path, Path]:
    """A draft (a random Llama of hidden `draft_hidden`, one attention head) and a target of hidden `width`
    that computes the same function: the draft's weights embedded in the target's first `draft_hidden`
    dimensions, one head and the first MLP units, every other weight zero, so the residual stream never
    leaves that subspace. The target's RMSNorms see `width / draft_hidden` times fewer mean squares: its eps
    is scaled by the same factor and the draft's norm weights by its square root, so both normalise alike.
    Acceptance is ~1 at every temperature (only summation order differs) while the target costs what a
    model of hidden `width` costs: the cost ratio is set by `width` alone (`width == draft_hidden`: the
    same model). Returns (target, draft)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if width % draft_hidden:
        raise ValueError(f"width {width} must be a multiple of draft_hidden {draft_hidden}")
    draft = build_tiny_llama(Path(root) / "draft", vocab_size=vocab_size, num_layers=num_layers,
                             hidden_size=draft_hidden, num_heads=1, seed=seed, lm_head_scale=lm_head_scale,
                             max_positions=max_positions)
    if width == draft_hidden:
        return draft, draft
    small = LlamaForCausalLM.from_pretrained(draft, torch_dtype=torch.float32)
    eps = small.config.rms_norm_eps
    h, i = draft_hidden, small.config.intermediate_size
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=num_layers,
        num_attention_heads=width // h, num_key_value_heads=width // h, head_dim=h,
        max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=vocab_size - 1, pad_token_id=None, torch_dtype="float32", rms_norm_eps=eps * h / width)
    big = LlamaForCausalLM(config).to(torch.float32)
    scale = (width / h) ** 0.5
    with torch.no_grad():
        for param in big.parameters():
            param.zero_()
        big.model.embed_tokens.weight[:, :h] = small.model.embed_tokens.weight
        big.lm_head.weight[:, :h] = small.lm_head.weight
        big.model.norm.weight[:h] = small.model.norm.weight / scale
        for b, s in zip(big.model.layers, small.model.layers, strict=True):
            b.input_layernorm.weight[:h] = s.input_layernorm.weight / scale
            b.post_attention_layernorm.weight[:h] = s.post_attention_layernorm.weight / scale
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(b.self_attn, name).weight[:h, :h] = getattr(s.self_attn, name).weight
            b.self_attn.o_proj.weight[:h, :h] = s.self_attn.o_proj.weight
            b.mlp.gate_proj.weight[:i, :h] = s.mlp.gate_proj.weight
            b.mlp.up_proj.weight[:i, :h] = s.mlp.up_proj.weight
            b.mlp.down_proj.weight[:h, :i] = s.mlp.down_proj.weight
    target = Path(root) / f"target-w{width}"
    target.mkdir(parents=True, exist_ok=True)
    big.save_pretrained(target, safe_serialization=True)
    return target, draft


def build_tiny_pair(root: Path, *, vocab_size: int = 24, draft_noise: float = 0.6) -> tuple[Path, Path]:
    """A target (2 layers) and a correlated draft (1 layer, perturbed LM head) under `root`."""
    target = build_tiny_llama(Path(root) / "target", vocab_size=vocab_size)
    draft = build_tiny_llama(Path(root) / "draft", vocab_size=vocab_size, num_layers=1, seed=1,
                             like=target, lm_head_noise=draft_noise)
    return target, draft


# -------------------------------------------------------------------------------------------- sampling

@dataclasses.dataclass
class SpecCounters:
    """vLLM's own spec-decode counters (`LLM.get_metrics()`), summed over the run."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0


@dataclasses.dataclass
class SampleRun:
    """What one engine produced: per variant, a [num_samples, max_tokens] array of token ids."""

    tokens: dict[str, np.ndarray]
    spec: SpecCounters
    generate_s: float
    total_s: float
    #: Saguaro's Prometheus samples at the end ('name{label="v"}' for labelled ones).
    saguaro: dict[str, float] = dataclasses.field(default_factory=dict)
    #: steps each of Saguaro's shortcuts around vLLM's code served (patches.SHORTCUT_STEPS)
    shortcuts: dict[str, int] = dataclasses.field(default_factory=dict)


#: One variant: `temperature=1.0` plain sampling. Variants are extra `SamplingParams` fields.
DEFAULT_VARIANTS: Mapping[str, Mapping[str, Any]] = {"t1": {"temperature": 1.0}}


def sample_outputs(model: str | Path, *, speculative_config: Mapping[str, Any] | None = None,
                   variants: Mapping[str, Mapping[str, Any]] = DEFAULT_VARIANTS, num_samples: int = 3000,
                   max_tokens: int = 5, prompt: Sequence[int] = PROMPT, seed: int = 0,
                   env: Mapping[str, str] | None = None, engine_kwargs: Mapping[str, Any] | None = None,
                   timeout_s: float = 300.0) -> SampleRun:
    """Start one `vllm.LLM` (in a fresh process) and sample `num_samples` completions per variant.

    Every request is the same `prompt` with `max_tokens` tokens, `ignore_eos`, and no per-request
    seed (vLLM's global RNG, seeded by `seed`, decides: reproducible without the per-request generator
    path). All variants share one batch, so they also share the engine's sampling metadata.
    `env` is added to this process's environment for the engine (e.g. `{"VLLM_PLUGINS": ""}`).
    Raises `EngineRunError` (with the engine's log tail) if the engine fails.
    """
    request = {
        "model": str(model), "speculative_config": dict(speculative_config) if speculative_config else None,
        "variants": {k: dict(v) for k, v in variants.items()}, "num_samples": num_samples,
        "max_tokens": max_tokens, "prompt": list(prompt), "seed": seed,
        "engine_kwargs": {**ENGINE_DEFAULTS, **(engine_kwargs or {})},
    }
    with tempfile.TemporaryDirectory(prefix="saguaro-dist-") as tmp:
        req_path, out_path, log_path = (Path(tmp) / n for n in ("request.json", "result.json", "log"))
        req_path.write_text(json.dumps(request))
        full_env = {**ENV_DEFAULTS, **os.environ, **(env or {})}
        start = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, __file__, str(req_path), str(out_path)], env=full_env,
                                  check=False, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        total_s = time.monotonic() - start
        if proc.returncode != 0 or not out_path.exists():
            raise EngineRunError(proc.returncode, log_path.read_text()[-6000:])
        result = json.loads(out_path.read_text())
    tokens = {k: np.asarray(v, dtype=np.int64) for k, v in result["tokens"].items()}
    return SampleRun(tokens, SpecCounters(**result["spec"]), result["generate_s"], total_s, result["saguaro"],
                     result["shortcuts"])


class EngineRunError(RuntimeError):
    def __init__(self, returncode: int, log_tail: str):
        super().__init__(f"engine process exited with {returncode}; log tail:\n{log_tail}")
        self.returncode = returncode
        self.log_tail = log_tail


def _run_engine(request: dict[str, Any]) -> dict[str, Any]:
    """The engine process: what `sample_outputs` runs in a fresh interpreter."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], speculative_config=request["speculative_config"],
              seed=request["seed"], **request["engine_kwargs"])
    prompts, params, owners = [], [], []
    for name, fields in request["variants"].items():
        sp = SamplingParams(max_tokens=request["max_tokens"], ignore_eos=True, detokenize=False, **fields)
        for _ in range(request["num_samples"]):
            prompts.append({"prompt_token_ids": request["prompt"]})
            params.append(sp)
            owners.append(name)
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.monotonic() - start
    tokens: dict[str, list[list[int]]] = {name: [] for name in request["variants"]}
    for owner, out in zip(owners, outputs):
        ids = list(out.outputs[0].token_ids)
        if len(ids) != request["max_tokens"]:
            raise RuntimeError(f"expected {request['max_tokens']} tokens, got {ids}")
        tokens[owner].append(ids)
    from saguaro_vllm.patches import SHORTCUT_STEPS
    from saguaro_vllm.worker.metrics import saguaro_samples

    return {"tokens": tokens, "spec": _spec_counters(llm.get_metrics()), "generate_s": generate_s,
            "saguaro": saguaro_samples(), "shortcuts": dict(SHORTCUT_STEPS)}


def _spec_counters(metrics: list[Any]) -> dict[str, int]:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counters = dict.fromkeys(names.values(), 0)
    for metric in metrics:
        key = names.get(metric.name.removesuffix("_total"))
        if key is not None:
            counters[key] += int(metric.value)
    return counters


# ---------------------------------------------------------------------------------------- statistics

def two_sample_chi2(a: Sequence[Any], b: Sequence[Any], *, min_count: int = 10) -> float:
    """p-value of the chi-square test that samples `a` and `b` (hashable outcomes) share a distribution.

    Outcomes seen fewer than `min_count` times in both samples together are pooled into one category
    (so every expected cell count is about `min_count / 2` or more; pooled cells of a well-filled
    table keep the test valid). Returns 1.0 when fewer than two categories remain.
    """
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    table, rest = [], [0, 0]
    for outcome in sorted(set(ca) | set(cb)):
        row = [ca[outcome], cb[outcome]]
        if sum(row) >= min_count:
            table.append(row)
        else:
            rest[0] += row[0]
            rest[1] += row[1]
    if sum(rest) > 0:
        table.append(rest)
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(np.asarray(table).T, correction=False).pvalue)


def compare(a: np.ndarray, b: np.ndarray, *, positions: Sequence[int] = (1, 2, 3, 4),
            joints: Sequence[tuple[int, int]] = ((2, 3),), min_count: int = 10) -> dict[str, float]:
    """Chi-square p-values comparing two [samples, tokens] arrays: one per marginal output position
    (`"pos2"`, ...) and one per joint of two positions (`"joint2,3"`, ...)."""
    out = {f"pos{i}": two_sample_chi2(a[:, i].tolist(), b[:, i].tolist(), min_count=min_count)
           for i in positions}
    for i, j in joints:
        out[f"joint{i},{j}"] = two_sample_chi2(list(map(tuple, a[:, [i, j]].tolist())),
                                               list(map(tuple, b[:, [i, j]].tolist())), min_count=min_count)
    return out


if __name__ == "__main__":
    request_path, result_path = sys.argv[1:3]
    result = _run_engine(json.loads(Path(request_path).read_text()))
    Path(result_path).write_text(json.dumps(result))
