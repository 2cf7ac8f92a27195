"""Cost-matched models: the trained demo models, zero-padded to the compute cost of much larger ones.

Why: SSD's benefit depends on the ratio of draft-step to target-step time. With a 70B target and a 1B draft
one draft step costs ~15-25% of a target step; the tiny trained models on CPU are instead dominated by fixed
per-step overheads, so benchmarks on them say little. A padded model computes *exactly* the same function as
the trained one (so acceptance is unchanged) while doing the matmuls of a 400M / 50M model.

How the padding stays exact (h real / H padded hidden dims, all extra weights zero unless stated):
  * embedding and (tied) LM head get zero columns, so the residual stream is zero in extra dims;
  * o_proj and down_proj have zero rows for extra dims and zero columns for extra heads / MLP units, and
    extra layers have zero o_proj / down_proj, so nothing ever writes into extra dims or changes real ones;
  * extra attention heads are appended after the real ones, with H_q / H_kv kept at the trained group size,
    so every real query head still reads its own real KV head (head size stays 64, so the softmax scale is
    unchanged); extra MLP units have zero gate/up rows (silu(0) * 0 = 0);
  * RMSNorm divides by the RMS over all H dims: with zeros in the extra dims the mean square shrinks by
    h/H, so eps is scaled by h/H and the weights by sqrt(h/H), giving exactly the trained normalisation:
        x / sqrt(h/H * (ms_h + eps)) * w * sqrt(h/H) = x / sqrt(ms_h + eps) * w.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import HEAD_DIM, ModelShape, parse_param_count


def cost_shape(real: ModelShape, params: int, vocab: int) -> ModelShape:
    """The padded shape, at least `real` in every dimension, whose parameter count is closest to `params`.

    Family: head size 64, hidden = 64 x heads, depth ~ hidden / 64, MLP ~ 8/3 hidden (Llama-like
    proportions), query/KV head ratio of the trained model kept so GQA groups are preserved.
    """
    group = real.heads // real.kv_heads
    best, best_err = real, abs(real.param_count(vocab) - params)
    hidden = real.hidden
    while True:
        heads = max(real.heads, hidden // HEAD_DIM)
        heads += -heads % group
        shape = ModelShape(
            hidden=hidden,
            layers=max(real.layers, round(hidden / 64)),
            heads=heads,
            kv_heads=heads // group,
            intermediate=max(real.intermediate, 64 * math.ceil(hidden * 8 / 3 / 64)),
        )
        count = shape.param_count(vocab)
        if abs(count - params) < best_err:
            best, best_err = shape, abs(count - params)
        if count > 2 * params:
            return best
        hidden += HEAD_DIM * group


def parse_scale(spec: str, real: ModelShape, vocab: int) -> ModelShape:
    """A cost scale is a parameter count (`400M`) or an explicit shape (`hidden=1024,layers=16,...`)."""
    if "=" in spec:
        shape = ModelShape.parse(spec)
    else:
        params = parse_param_count(spec)
        if params < real.param_count(vocab):
            raise ValueError(f"cost scale {spec!r} is below the trained model's "
                             f"{real.param_count(vocab) / 1e6:.2f}M parameters")
        shape = cost_shape(real, params, vocab)
    too_small = [f for f, v in real.as_dict().items() if getattr(shape, f) < v]
    if too_small or shape.heads // shape.kv_heads != real.heads // real.kv_heads:
        raise ValueError(
            f"cost scale {spec!r} gives {shape}, which cannot hold the trained {real} "
            f"(too small in {too_small or 'the query/KV head ratio'})"
        )
    return shape


def _embed(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = torch.zeros(rows, cols, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def pad_state_dict(sd: dict[str, torch.Tensor], real: ModelShape, big: ModelShape) -> dict[str, torch.Tensor]:
    """Zero-pad a tied-embedding HF Llama state dict of shape `real` to shape `big` (see module docstring)."""
    h, H = real.hidden, big.hidden
    norm_scale = math.sqrt(h / H)
    q_rows, kv_rows, inter = big.heads * HEAD_DIM, big.kv_heads * HEAD_DIM, big.intermediate
    embed = sd["model.embed_tokens.weight"]
    out = {"model.embed_tokens.weight": _embed(embed, embed.shape[0], H)}
    out["model.norm.weight"] = _embed(sd["model.norm.weight"][None] * norm_scale, 1, H)[0]
    shapes = {"q_proj": (q_rows, H), "k_proj": (kv_rows, H), "v_proj": (kv_rows, H), "o_proj": (H, q_rows)}
    mlp_shapes = {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}
    dtype = embed.dtype
    for i in range(big.layers):
        p = f"model.layers.{i}."
        real_layer = i < real.layers
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w = sd[p + norm + ".weight"][None] * norm_scale if real_layer else torch.zeros(1, h, dtype=dtype)
            out[p + norm + ".weight"] = _embed(w, 1, H)[0]
        for group, table in (("self_attn", shapes), ("mlp", mlp_shapes)):
            for name, (rows, cols) in table.items():
                key = f"{p}{group}.{name}.weight"
                out[key] = _embed(sd[key], rows, cols) if real_layer else torch.zeros(rows, cols, dtype=dtype)
    return out


def write_cost_matched(src: Path, dst: Path, real: ModelShape, big: ModelShape) -> dict:
    """Write the padded model `big` of the trained model in `src` into `dst` (config + weights).

    Tokenizer files are the caller's job. Returns the config fields that changed.
    """
    config = json.loads((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    padded = pad_state_dict(sd, real, big)
    eps = config["rms_norm_eps"] * real.hidden / big.hidden
    config.update(**big.hf_shape_fields(), rms_norm_eps=eps)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(padded, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name in ("generation_config.json",):
        if (src / name).exists():
            (dst / name).write_bytes((src / name).read_bytes())
    return {"rms_norm_eps": eps, "shape": big.as_dict()}


@torch.no_grad()
def decode_step_seconds(model: torch.nn.Module, prompt: torch.Tensor, steps: int = 16, warmup: int = 3) -> float:
    """Median time of one batch-1 decode step (KV cache) after `prompt`, on the current thread setting."""
    model.eval()
    out = model(input_ids=prompt[None], use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
