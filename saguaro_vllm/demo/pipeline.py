"""The stages of a demo-pair build: tokenizer, target, draft (pre-train + distil), evaluation, cost matching.

Why separate from build.py: build.py owns caching, locking and atomic output; this module only turns a
settings object and an empty directory into models and a stats dict. Time budgets are split in fixed
fractions and converted to step / sequence counts, so the result depends only on settings and seed.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .corpus import Corpus, snippets
from .distill import (
    SoftLabelLoss,
    distill_batches,
    generate_distill_set,
    greedy_continue,
    measure_agreement,
    measure_sampled_acceptance,
    reference_continuations,
    sample_prompts,
    soft_distill_batches,
)
from .model import ModelShape
from .tokenizer import EOS, copy_tokenizer_files, save_tokenizer, train_tokenizer
from .train import TokenStream, TrainSchedule, heldout_loss, steps_for_budget, train_lm

# Pre-training uses small batches (at this budget, 8x256 beat 16x256 and 4x256 at equal compute);
# distillation uses 16, as its sequences are far more predictable.
BATCH, DISTILL_BATCH, SEQ = 8, 16, 256
PROMPT_LEN, CONTINUATION = 64, 192  # distillation / agreement sequences fill one training window
MAX_POSITIONS = 2048
# Shares of the `minutes` budget. Generation is converted with GEN_TOKENS_PER_SECOND, measured for the
# default target on the 2-core reference machines (batch-64 greedy decoding with HF's KV cache).
SHARE_TARGET, SHARE_DRAFT_PRETRAIN, SHARE_GENERATE, SHARE_DISTILL = 0.55, 0.08, 0.1, 0.27
GEN_TOKENS_PER_SECOND = 3000.0
LR_TARGET, LR_DRAFT = 3e-3, 3e-3  # 3e-3 beat 5e-3 and 1e-2 for the target
HELDOUT_EVAL_TOKENS = 65536
AGREEMENT_PROMPTS = 64
# The soft recipe's generated text: batches alternate between T=1 samples and greedy continuations, so the
# draft sees both the contexts sampled serving produces and the ones greedy serving does.
SOFT_GEN_TEMPERATURES = (1.0, 0.0)
SOFT_HARD_WEIGHT = 1.0  # weight of the cross-entropy on greedy continuations in the soft recipe
ACCEPTANCE_TEMPERATURES = (0.7, 1.0)
HELDOUT_PROMPTS, HELDOUT_PROMPT_CHARS = 256, 400
COST_DIRS = ("target-cost", "draft-cost")


def _stream(tok, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16 if tok.get_vocab_size() <= 65536 else np.int32)


def _new_model(shape: ModelShape, vocab: int, eos: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(shape.hf_config(vocab, MAX_POSITIONS, eos)).float()


class _Stages:
    """Wall-clock seconds per build stage, for stats.json."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name, self._t = None, time.time()

    def start(self, name: str) -> None:
        now = time.time()
        if self._name:
            self.seconds[self._name] = round(now - self._t, 1)
        self._name, self._t = name, now


def build_pair(out: Path, settings, corpus: Corpus, log) -> dict:
    """Train tokenizer, target and draft into `out`; write stats.json and heldout.json; return the stats."""
    t_start, cpu_start, stages = time.time(), time.process_time(), _Stages()
    budget, seed = settings.minutes * 60, settings.seed
    t_shape, d_shape = settings.target_shape, settings.draft_shape
    log(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out files from {corpus.root}")
    stages.start("tokenizer")
    train_texts, heldout_texts = corpus.texts("train"), corpus.texts("heldout")
    log(f"training byte-level BPE tokenizer ({settings.vocab_size} tokens)")
    tok = train_tokenizer(train_texts, settings.vocab_size)
    vocab, eos = tok.get_vocab_size(), tok.token_to_id(EOS)
    save_tokenizer(tok, out / "target", MAX_POSITIONS)
    (out / "draft").mkdir()
    copy_tokenizer_files(out / "target", out / "draft")
    train_ids, heldout_ids = _stream(tok, train_texts), _stream(tok, heldout_texts)
    stream = TokenStream(train_ids)

    stages.start("target")
    t_steps = steps_for_budget(budget * SHARE_TARGET, t_shape, vocab, BATCH, SEQ)
    log(f"pre-training target {t_shape} ({t_shape.param_count(vocab) / 1e6:.2f}M params, {t_steps} steps)")
    target = _new_model(t_shape, vocab, eos, seed)
    target_loss = train_lm(target, stream.windows(BATCH, SEQ, np.random.default_rng([seed, 1])),
                           TrainSchedule(t_steps, LR_TARGET), "target")
    target.save_pretrained(out / "target")

    stages.start("draft_pretrain")
    dp_steps = steps_for_budget(budget * SHARE_DRAFT_PRETRAIN, d_shape, vocab, BATCH, SEQ)
    log(f"pre-training draft {d_shape} ({d_shape.param_count(vocab) / 1e6:.2f}M params, {dp_steps} steps)")
    draft = _new_model(d_shape, vocab, eos, seed + 1)
    train_lm(draft, stream.windows(BATCH, SEQ, np.random.default_rng([seed, 2])),
             TrainSchedule(dp_steps, LR_DRAFT), "draft pre-train")

    stages.start("agreement_reference")
    log("target continuations of held-out prompts (agreement references, greedy and sampled)")
    agree_prompts = sample_prompts(heldout_ids, AGREEMENT_PROMPTS, PROMPT_LEN, np.random.default_rng([seed, 3]))
    reference = reference_continuations(target, agree_prompts, CONTINUATION)
    sampled_refs = {t: reference_continuations(target, agree_prompts, CONTINUATION, t, seed + 7)
                    for t in ACCEPTANCE_TEMPERATURES}

    def sampled_acceptance() -> dict:
        return {str(t): measure_sampled_acceptance(target, draft, seqs, PROMPT_LEN, t)
                for t, seqs in sampled_refs.items()}

    before = measure_agreement(draft, reference, PROMPT_LEN)
    before_sampled = sampled_acceptance()
    draft_loss_before = heldout_loss(draft, heldout_ids, SEQ, HELDOUT_EVAL_TOKENS)
    log(f"draft before distillation: agreement {before.per_token:.3f}, acceptance at T=1 "
        f"{before_sampled['1.0'].per_token:.3f}, held-out loss {draft_loss_before:.3f}")

    soft = settings.distill == "soft"
    stages.start("generate")
    temperatures = SOFT_GEN_TEMPERATURES if soft else (0.0,)
    n_seqs = max(DISTILL_BATCH, int(budget * SHARE_GENERATE * GEN_TOKENS_PER_SECOND / CONTINUATION))
    log(f"generating {n_seqs} x {CONTINUATION} target tokens for distillation (temperatures {temperatures})")
    distill_set, row_temps = generate_distill_set(target, train_ids, n_seqs, PROMPT_LEN, CONTINUATION, seed + 4,
                                       temperatures=temperatures)

    stages.start("distill")
    corpus_batches = stream.windows(DISTILL_BATCH, SEQ, np.random.default_rng([seed, 6]))
    rng = np.random.default_rng([seed, 5])
    if soft:
        ds_steps = steps_for_budget(budget * SHARE_DISTILL, d_shape, vocab, DISTILL_BATCH, SEQ, teacher=t_shape)
        log(f"distilling draft on the target's soft labels ({ds_steps} steps, every other batch corpus text)")
        greedy_rows = row_temps == 0
        batches = soft_distill_batches(distill_set, greedy_rows, DISTILL_BATCH, rng, corpus_batches)
        draft_loss = train_lm(draft, batches, TrainSchedule(ds_steps, LR_DRAFT, warmup=5), "draft distil (soft)",
                              loss_fn=SoftLabelLoss(target, PROMPT_LEN, SOFT_HARD_WEIGHT))
    else:
        ds_steps = steps_for_budget(budget * SHARE_DISTILL, d_shape, vocab, DISTILL_BATCH, SEQ)
        log(f"distilling draft on target greedy continuations ({ds_steps} steps, every other batch corpus text)")
        batches = distill_batches(distill_set, PROMPT_LEN, DISTILL_BATCH, rng, corpus_batches)
        draft_loss = train_lm(draft, batches, TrainSchedule(ds_steps, LR_DRAFT, warmup=5), "draft distil (hard)")
    draft.save_pretrained(out / "draft")

    stages.start("evaluate")
    log("evaluating held-out loss, agreement and sampled acceptance")
    after = measure_agreement(draft, reference, PROMPT_LEN)
    after_sampled = sampled_acceptance()
    stats = {
        "builder": {"minutes": settings.minutes, "seed": seed, "python": sys.version.split()[0],
                    "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads()},
        "corpus": {"root": str(corpus.root), "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                   "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids)},
        "tokenizer": {"vocab_size": vocab, "eos": EOS},
        "target": {"shape": t_shape.as_dict(), "params": t_shape.param_count(vocab), "steps": t_steps,
                   "batch": [BATCH, SEQ], "train_loss": round(target_loss, 4),
                   "heldout_loss": round(heldout_loss(target, heldout_ids, SEQ, HELDOUT_EVAL_TOKENS), 4)},
        "draft": {"shape": d_shape.as_dict(), "params": d_shape.param_count(vocab), "pretrain_steps": dp_steps,
                  "distill_steps": ds_steps, "distill_recipe": settings.distill,
                  "train_loss": round(draft_loss, 4),
                  "train_loss_kind": (f"forward KL to the target + {SOFT_HARD_WEIGHT} x cross-entropy on greedy "
                                      "continuations") if soft else "cross-entropy",
                  "heldout_loss_before_distill": round(draft_loss_before, 4),
                  "heldout_loss": round(heldout_loss(draft, heldout_ids, SEQ, HELDOUT_EVAL_TOKENS), 4)},
        "distill": {"recipe": settings.distill, "sequences": n_seqs, "prompt_tokens": PROMPT_LEN,
                    "generated_tokens": n_seqs * CONTINUATION, "temperatures": list(temperatures),
                    **({"hard_weight": SOFT_HARD_WEIGHT} if soft else {})},
        "agreement": {"per_token": round(after.per_token, 4), "per_token_stderr": round(after.stderr, 4),
                      "mean_accept_len": round(after.mean_accept_len, 3),
                      "k": after.k, "tokens": after.tokens, "prompts": AGREEMENT_PROMPTS,
                      "before_distill": {"per_token": round(before.per_token, 4),
                                         "mean_accept_len": round(before.mean_accept_len, 3)}},
        "sampled_acceptance": {t: {**_acceptance_dict(a), "before_distill": _acceptance_dict(before_sampled[t])}
                               for t, a in after_sampled.items()},
        "heldout_eval_tokens": SEQ * min(len(heldout_ids) // SEQ, HELDOUT_EVAL_TOKENS // SEQ),
    }
    stages.start("")
    stats["stage_seconds"] = stages.seconds
    stats["build_seconds"] = round(time.time() - t_start, 1)
    stats["build_cpu_seconds"] = round(time.process_time() - cpu_start, 1)
    (out / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    heldout = {"corpus_root": str(corpus.root), "files": list(corpus.heldout),
               "prompts": list(snippets(heldout_texts, HELDOUT_PROMPTS, HELDOUT_PROMPT_CHARS, seed))}
    (out / "heldout.json").write_text(json.dumps(heldout, indent=1) + "\n")
    log(summary(stats))
    return stats


def _acceptance_dict(a) -> dict:
    return {"per_token": round(a.per_token, 4), "per_token_stderr": round(a.stderr, 4),
            "mean_accept_len": round(a.mean_accept_len, 3), "k": a.k, "tokens": a.tokens}


def summary(stats: dict) -> str:
    t, d, a = stats["target"], stats["draft"], stats["agreement"]
    stderr = f" +- {a['per_token_stderr']:.3f}" if "per_token_stderr" in a else ""  # absent in older builds
    sampled = "".join(f"; acceptance at T={temp}: {s['per_token']:.3f} +- {s['per_token_stderr']:.3f} "
                      f"(before distillation {s['before_distill']['per_token']:.3f})"
                      for temp, s in stats.get("sampled_acceptance", {}).items())
    return (f"held-out loss: target {t['heldout_loss']:.3f}, draft {d['heldout_loss']:.3f} nats/token; "
            f"greedy agreement {a['per_token']:.3f}{stderr} "
            f"(before distillation {a['before_distill']['per_token']:.3f}), "
            f"mean accepted length at K={a['k']}: {a['mean_accept_len']:.2f}{sampled}")


def _load(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _compare(small, big, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Max |logit difference| on `prompts` and whether greedy continuations are identical."""
    diff = (small(input_ids=prompts).logits - big(input_ids=prompts).logits).abs().max().item()
    same = bool(torch.equal(greedy_continue(small, prompts, new_tokens), greedy_continue(big, prompts, new_tokens)))
    return {"max_abs_logit_diff": diff, "greedy_identical": same}


def build_cost_matched(root: Path, stats: dict, target_scale: str, draft_scale: str, log) -> dict:
    """Write target-cost/ and draft-cost/ beside the trained models, verify them, time one decode step each."""
    from tokenizers import Tokenizer

    from .cost_match import decode_step_seconds, parse_scale, write_cost_matched
    from .storage import staging_dir

    vocab = stats["tokenizer"]["vocab_size"]
    real = {n: ModelShape(**stats[n]["shape"]) for n in ("target", "draft")}
    big = {"target": parse_scale(target_scale, real["target"], vocab),
           "draft": parse_scale(draft_scale, real["draft"], vocab)}
    tok = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    texts = json.loads((root / "heldout.json").read_text())["prompts"][:4]
    length = min(len(tok.encode(t).ids) for t in texts)
    prompts = torch.tensor([tok.encode(t).ids[: min(48, length)] for t in texts])
    result: dict = {}
    for name in ("target", "draft"):
        shape = big[name]
        log(f"writing cost-matched {name}: {shape} ({shape.param_count(vocab) / 1e6:.0f}M parameter-cost)")
        with staging_dir(root / f"{name}-cost") as tmp:
            info = write_cost_matched(root / name, tmp, real[name], shape)
            copy_tokenizer_files(root / name, tmp)
            check = _compare(_load(root / name), _load(tmp), prompts, 32)
            if check["max_abs_logit_diff"] > 1e-3:
                raise RuntimeError(f"cost-matched {name} differs from the trained model: {check} (a bug)")
            if not check["greedy_identical"]:
                log(f"warning: cost-matched {name} greedy continuation differs (a near-tie in fp32)")
        result[name] = {**info, "params": shape.param_count(vocab), **check}

    log("timing one batch-1 decode step of each model (1 thread)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompt = prompts[0]
        for name in ("target", "draft"):
            result[name]["step_ms"] = round(1e3 * decode_step_seconds(_load(root / f"{name}-cost"), prompt), 2)
            result[name]["trained_step_ms"] = round(1e3 * decode_step_seconds(_load(root / name), prompt), 2)
    finally:
        torch.set_num_threads(threads)
    result["draft_target_step_ratio"] = round(result["draft"]["step_ms"] / result["target"]["step_ms"], 3)
    result["trained_draft_target_step_ratio"] = round(
        result["draft"]["trained_step_ms"] / result["target"]["trained_step_ms"], 3)
    log(f"decode step (1 thread): cost-matched target {result['target']['step_ms']} ms, draft "
        f"{result['draft']['step_ms']} ms, ratio {result['draft_target_step_ratio']} (trained models: "
        f"{result['target']['trained_step_ms']} / {result['draft']['trained_step_ms']} ms)")
    return result
