"""The real-vocabulary models and the plain engine's jobs, shared by tests/test_real_vocab.py and tests/test_tp.py
(test helper, not a test): one pair per vocabulary and one plain vLLM run at vocabulary 128256 serve both files
(conftest.py's session fixtures `pair128k` and `plain128k`), so the tensor-parallel engines of test_tp.py are
compared with the plain engine test_real_vocab.py starts anyway.

The models are tiny random Llamas (2 layers, hidden 64, 2 heads: TP=2 splits them) built here. The target is
peaked: its LM head is zero except for 32 "live" tokens spread over the whole vocabulary (ids up to vocab-1;
vocab-1, vocab-2, 65535 and 65536 among them; at 128256, 15 of them lie in TP rank 0's half of the
vocabulary, [0, 64128), and 17 in rank 1's), whose logits have a spread of about 6, so a context's best live
token takes about half the probability mass, a few others most of the rest, and the ~128k dead tokens share
what is left (pooled by the chi-square test). The draft is the target with one layer fewer and a perturbed
LM head.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from distribution import build_tiny_llama
from engine_runs import Job

LIVE = 32
MAX_MODEL_LEN = 3200
LONG_PROMPT = 3000
#: T=1 samples of the `t1` job (5 tokens each; `max_num_seqs` 64: ~90 % of its verification steps have 64 rows)
SAMPLES = 1000
ENGINE = {"skip_tokenizer_init": True, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 64,
          "enable_prefix_caching": False}
T1 = {"temperature": 1.0, "ignore_eos": True}


def build_peaked_pair(root: Path, vocab: int) -> tuple[Path, Path]:
    """Target (2 layers) and draft (1 layer, perturbed head) with the peaked LM head described above."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(vocab)
    live = torch.cat([torch.tensor([vocab - 1, vocab - 2, 65535, 65536]),
                      torch.randperm(vocab - 2, generator=gen)[: LIVE - 4]])
    paths = []
    for name, layers, noise in (("target", 2, 0.0), ("draft", 1, 0.6)):
        path = build_tiny_llama(root / name, vocab_size=vocab, num_layers=layers, hidden_size=64, num_heads=2,
                                seed=0, max_positions=MAX_MODEL_LEN + 64)
        file = path / "model.safetensors"
        state = load_file(str(file))
        if name == "target":
            head = torch.randn(vocab, 64, generator=gen) * 0.002  # dead tokens: logits ~ +-0.016, no exact ties
            head[live] = torch.randn(LIVE, 64, generator=gen) * 0.75  # live: |h| = 8 after RMSNorm -> sd ~6
            target_head = head
            target_state = state
        else:  # the target's embedding and first layer, a noisy copy of its head
            state = {k: v for k, v in target_state.items() if ".layers.1." not in k}
            head = target_head.clone()
            head[live] += torch.randn(LIVE, 64, generator=gen) * 0.75 * noise
        state["lm_head.weight"] = head.contiguous()
        save_file(state, str(file), metadata={"format": "pt"})
        paths.append(path)
    return paths[0], paths[1]


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab - 1, length).tolist() for _ in range(n)]


def greedy_jobs(vocab: int) -> list[Job]:
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    return [
        Job("b1", prompts(vocab, 2, 12, 1), greedy, sequential=True),
        Job("b64", prompts(vocab, 64, 10, 2), greedy),
        Job("long", prompts(vocab, 1, LONG_PROMPT, 3), {**greedy, "max_tokens": 16}),
        # n > 1 needs sampling; top-k 1 makes every completion the argmax path (sampled rows, top-k in q')
        Job("n3", prompts(vocab, 2, 8, 4), {**greedy, "temperature": 1.0, "top_k": 1, "n": 3}),
    ]


def t1_job(vocab: int) -> Job:
    """SAMPLES requests of 5 tokens at T=1, one prompt, in one `generate`: 64 rows in flight, each step's rows
    a mix of prefills and requests at their first verifications."""
    return Job("t1", [[5, 17, vocab - 3, 101, 9]] * SAMPLES, {**T1, "max_tokens": 5})
