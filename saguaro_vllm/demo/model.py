"""Shapes of the demo models and their Hugging Face `LlamaConfig`.

Why a small shape type: the trained models and the cost-matched (zero-padded) ones are the same family at
different sizes, and padding needs every dimension explicitly. Head size is 64 because vLLM's CPU attention
kernels reject smaller heads. Embeddings are tied, as is usual for models this small.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

HEAD_DIM = 64
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) <= 0:
            raise ValueError(f"all model dimensions must be positive: {self}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @classmethod
    def parse(cls, spec: str) -> ModelShape:
        """Parse `hidden=192,layers=2,heads=3,kv_heads=3,intermediate=512` (kv_heads defaults to heads)."""
        try:
            fields = dict(item.split("=", 1) for item in spec.replace(" ", "").split(","))
            values = {k: int(v) for k, v in fields.items()}
            values.setdefault("kv_heads", values.get("heads", 0))
            return cls(**values)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"bad model shape {spec!r} ({e}); expected e.g. "
                "'hidden=192,layers=2,heads=3,kv_heads=3,intermediate=512'"
            ) from None

    def as_dict(self) -> dict:
        return asdict(self)

    def param_count(self, vocab: int) -> int:
        """Parameters of a tied-embedding Llama of this shape (norm weights included)."""
        attn = self.hidden * HEAD_DIM * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return vocab * self.hidden + self.layers * (attn + mlp + 2 * self.hidden) + self.hidden

    def hf_shape_fields(self) -> dict:
        """This shape as Hugging Face Llama config fields (also used to rewrite a saved config)."""
        return dict(hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads)

    def hf_config(self, vocab: int, max_positions: int, eos_id: int, rms_norm_eps: float = RMS_NORM_EPS):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab,
            **self.hf_shape_fields(),
            head_dim=HEAD_DIM,
            hidden_act="silu",
            max_position_embeddings=max_positions,
            rms_norm_eps=rms_norm_eps,
            rope_theta=ROPE_THETA,
            tie_word_embeddings=True,
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            torch_dtype="float32",
        )


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*$")


def parse_param_count(spec: str) -> int:
    """Parse `400M`, `50m`, `1.5B`, `250000` into a parameter count."""
    m = _SIZE.match(spec)
    if not m:
        raise ValueError(f"bad parameter count {spec!r}; expected e.g. '400M', '50M', '1.2B'")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)
