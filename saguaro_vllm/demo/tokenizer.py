"""The shared byte-level BPE tokenizer of the demo pair, in the file layout HF and vLLM load directly.

Why byte-level BPE: every byte sequence round-trips (stdlib files include latin-1 and odd whitespace), and
the `tokenizers` trainer needs no download. One tokenizer serves both models, as speculative decoding needs.
Documents are separated by a single `<|endoftext|>` (GPT-2 style, also the bos/eos token); nothing is
prepended automatically, so a prompt cut from the middle of a file looks like the training windows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
# The models only know Python source, so a chat renders as Python comments and the reply continues code.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '# ' + message['role'] + ': ' + message['content'] | replace('\\n', '\\n# ') + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `vocab_size` entries (256 byte tokens, merges, and EOS)."""
    # The trainer is multi-threaded through rayon; on a shared 2-core box one thread is plenty fast.
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json plus the small config files `AutoTokenizer` and vLLM read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        (dst_dir / name).write_bytes((src_dir / name).read_bytes())
