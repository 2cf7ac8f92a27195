"""Language-model training and evaluation loops for the demo models.

Why step budgets instead of wall-clock: a build must be deterministic for a seed, so `--minutes` is turned
into a fixed number of optimiser steps with a FLOP estimate calibrated on the 2-core reference machines
(REFERENCE_FLOPS). On a faster machine the build finishes sooner with the same result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .model import HEAD_DIM, ModelShape

# Sustained fp32 training throughput (forward + backward + AdamW) of HF Llama on the 2-core AVX2 reference
# machines, in FLOP/s. Only used to turn time budgets into step counts.
REFERENCE_FLOPS = 60e9
IGNORE = -100


def train_flops_per_token(shape: ModelShape, vocab: int, seq: int) -> float:
    """Approximate training FLOPs per token: 6 x matmul parameters plus attention scores (causal)."""
    matmul_params = shape.layers * (
        shape.hidden * HEAD_DIM * (2 * shape.heads + 2 * shape.kv_heads) + 3 * shape.hidden * shape.intermediate
    ) + vocab * shape.hidden
    attention = shape.layers * shape.heads * HEAD_DIM * seq * 2  # QK^T and PV, halved by causality, x2 mul-add
    return 6.0 * matmul_params + 3.0 * attention


def steps_for_budget(
    seconds: float, shape: ModelShape, vocab: int, batch: int, seq: int, teacher: ModelShape | None = None
) -> int:
    """Optimiser steps that fit `seconds`; with a `teacher`, each step also pays its forward (a third of
    its training FLOPs)."""
    per_token = train_flops_per_token(shape, vocab, seq)
    if teacher is not None:
        per_token += train_flops_per_token(teacher, vocab, seq) / 3
    per_step = per_token * batch * seq / REFERENCE_FLOPS
    return max(1, int(seconds / per_step))


class TokenStream:
    """All training tokens as one array (documents separated by EOS); samples random fixed-length windows."""

    def __init__(self, ids: np.ndarray):
        if ids.ndim != 1 or len(ids) < 2:
            raise ValueError("token stream must be a non-empty 1-D array")
        self.ids = ids

    def windows(self, batch: int, seq: int, rng: np.random.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless (input_ids, labels) batches of random windows; labels equal inputs (HF shifts them)."""
        seq = min(seq, len(self.ids))
        while True:
            starts = rng.integers(0, len(self.ids) - seq + 1, size=batch)
            x = torch.from_numpy(np.stack([self.ids[s : s + seq] for s in starts]).astype(np.int64))
            yield x, x


@dataclass
class TrainSchedule:
    steps: int
    lr: float
    warmup: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    clip: float = 1.0

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train_lm(
    model: torch.nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    schedule: TrainSchedule,
    desc: str,
    on_step: Callable[[int, float], None] | None = None,
    loss_fn: Callable[[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor] | None = None,
) -> float:
    """Train `model` for `schedule.steps` AdamW steps on `batches`; returns the final smoothed loss.

    `loss_fn(model, batch)` replaces the default next-token cross-entropy on `batch`'s labels.
    """
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": schedule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=schedule.lr,
        betas=(0.9, 0.95),
    )
    smooth = float("nan")
    bar = tqdm(range(schedule.steps), desc=desc, unit="step", dynamic_ncols=True, leave=False)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = schedule.lr_at(step)
        batch = next(batches)
        loss = model(input_ids=batch[0], labels=batch[1]).loss if loss_fn is None else loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip)
        opt.step()
        value = loss.item()
        smooth = value if math.isnan(smooth) else 0.95 * smooth + 0.05 * value
        bar.set_postfix(loss=f"{smooth:.3f}")
        if on_step is not None:
            on_step(step, value)
    bar.close()
    model.eval()
    return smooth


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, ids: np.ndarray, seq: int, max_tokens: int, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over up to `max_tokens` tokens of `ids`.

    The windows are non-overlapping and spread evenly over the whole stream, so a budget smaller than the
    stream still samples every part of it (files differ a lot in how predictable they are).
    """
    model.eval()
    seq = min(seq, len(ids))
    n_windows = max(1, min(len(ids) // seq, max_tokens // seq))
    starts = np.linspace(0, len(ids) - seq, n_windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([ids[s : s + seq] for s in starts]).astype(np.int64))
    total, count = 0.0, 0
    for i in range(0, n_windows, batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += x[:, 1:].numel()
    return total / count
