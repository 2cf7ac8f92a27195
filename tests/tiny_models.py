"""Tiny random-weight Llama target/draft pairs with a real tokenizer, built by the tests themselves.

The draft is the target with Gaussian noise on its weights: it agrees with the target often but not always,
so tests see both accepted and rejected drafts. Random weights are fine for exactness tests: they check that
speculation never changes what the target would have produced.
"""
from __future__ import annotations

import json
import pathlib

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nimport sys\nprint(os.getcwd(), sys.argv)\n",
]


def build_tokenizer(out: pathlib.Path, vocab_size: int = 320) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
    }))
    return tok.get_vocab_size()


def _save_llama(out: pathlib.Path, state: dict | None, vocab: int, seed: int, **overrides) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype="float32",
                      **overrides)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Sharper logits than the default init, so greedy choices are not near-ties.
        model.lm_head.weight.mul_(8.0)
        if state is not None:
            model.load_state_dict(state)
    model.save_pretrained(out, safe_serialization=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def build_tiny_pair(root: pathlib.Path, draft_noise: float = 0.35, seed: int = 0) -> tuple[str, str]:
    """(target_dir, draft_dir) under `root`; both share one tokenizer."""
    target, draft = root / "target", root / "draft"
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).write_bytes((target / name).read_bytes())
    state = _save_llama(target, None, vocab, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    noisy = {k: v + draft_noise * v.std() * torch.randn(v.shape, generator=gen) if v.ndim > 1 else v
             for k, v in state.items()}
    _save_llama(draft, noisy, vocab, seed)
    return str(target), str(draft)
