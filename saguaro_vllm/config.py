"""The user's interface: the `--speculative-config` JSON, validated into one pydantic model.

```json
{"method": "saguaro", "model": "<draft dir or HF id>", "num_speculative_tokens": 5,
 "saguaro": {"mode": "sync", "device": "auto", ...}}
```
Every Saguaro knob lives in the nested `"saguaro"` object (`SaguaroOptions`); `docs/configuration.md`
documents each field. Errors name the field and the fix, and are raised in the front-end process, before
any engine process starts.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROPOSER_CLASS = "saguaro_vllm.proposer.SaguaroProposer"
ADDITIONAL_CONFIG_KEY = "saguaro"
MAX_SPECULATIVE_TOKENS = 32


class SaguaroConfigError(ValueError):
    """A bad Saguaro speculative config; the message names the field and the fix."""


class SaguaroOptions(BaseModel):
    """The nested `"saguaro"` object of the speculative config."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["sync", "async"] = Field(
        "sync",
        description="`sync`: the drafter drafts K tokens after each verification while the target waits "
        "(optimized speculative decoding). `async`: speculative speculative decoding (SSD): the drafter "
        "pre-drafts likely outcomes during verification.",
    )
    device: str = Field(
        "auto",
        description="Where the draft model runs: `cpu`, `cuda:N`, or `auto` (CPU on a CPU build of vLLM; "
        "on GPUs the first GPU after the target's tensor-parallel GPUs).",
    )
    draft_cores: list[int] | None = Field(
        None,
        description="CPU only: the core ids the drafter process is pinned to. Default: the upper half of "
        "the cores this process may use (at least one).",
    )
    target_cores: list[int] | None = Field(
        None,
        description="CPU only: the core ids of the target worker (sets VLLM_CPU_OMP_THREADS_BIND unless "
        "you set it yourself). Default: the cores not given to the drafter.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Draft weights and KV dtype. `auto`: on CPU bfloat16 where the CPU has bf16 "
        "matrix instructions (AVX512-BF16 or AMX), else float32; the target's dtype on GPU."
    )
    linear: Literal["auto", "plain", "packed", "int8"] = Field(
        "auto", description="The matmul path of the draft's linear layers. `plain`: `F.linear`. `packed`: CPU, "
        "bfloat16: oneDNN with weights pre-packed once at load (same numerics, ~1.4x faster). `int8`: CPU: "
        "int8 weights per output channel, activations quantized per call (fbgemm; 2-3x faster at 1-13 rows, "
        "a slightly different draft, so acceptance may change; output stays exact). `auto`: `packed` for a "
        "bfloat16 drafter on CPU, else `plain`."
    )
    block_size: int = Field(16, description="Tokens per block of the drafter's paged KV cache.")
    kv_cache_gb: float = Field(
        1.0, description="Memory for the drafter's KV cache, in GiB (sizes the number of blocks)."
    )
    max_tokens_per_forward: int = Field(
        2048, description="Prefill chunk size: at most this many tokens of one request per drafter forward "
        "(long prompts are prefilled in chunks)."
    )
    step_timeout_s: float = Field(
        30.0,
        description="How long the proposer waits for the drafter's answer in one step before giving up on "
        "drafts for that step (the request continues without speculation; output is unaffected).",
    )
    startup_timeout_s: float = Field(600.0, description="How long to wait for the drafter process to load.")
    log_interval_s: float = Field(10.0, description="Seconds between Saguaro log lines (0 disables).")
    fanout: list[int] | None = Field(
        None,
        description="`async` only: fixed fan-out per accepted depth 0..K (K+1 numbers: how many bonus "
        "tokens to pre-draft for \"exactly j drafts accepted\"). Default: computed online from the measured "
        "acceptance rate (geometric allocation) and sized to finish before the verification returns.",
    )
    fanout_budget: int | None = Field(
        None,
        description="`async` only: fixed number of pre-drafted branches per request and round (the fan-out "
        "is spread over the depths automatically). Default: sized from measured drafter step and "
        "verification times. Ignored when `fanout` is set.",
    )
    max_fanout_budget: int = Field(
        32, description="`async` only: upper bound of the automatically sized branches per request and round."
    )
    miss_fanout: list[int] | None = Field(
        None,
        description="`async` only: fixed fan-out per depth (K+1 numbers) for rounds whose drafts came from "
        "the n-gram backup. Default: `fanout` when that is set, else computed online from the backup's own "
        "acceptance estimate.",
    )
    backup: Literal["auto", "jit", "ngram"] = Field(
        "auto",
        description="`async` only: what a speculation-cache miss gets. `jit`: the drafter drafts K tokens "
        "now (on the critical path). `ngram`: drafts copied from an earlier occurrence of the context's "
        "last tokens (nearly free, rarely accepted). `auto`: per step, whichever the measured timings, "
        "hit rate, acceptance and batch size say yields more tokens per second (docs/algorithm.md).",
    )
    finish_predraft: bool = Field(
        False,
        description="`async` only: when an outcome arrives before pre-drafting is done, `false` cuts it "
        "short (branches drafted so far are cached; a hit on a short branch is completed on the spot), "
        "`true` finishes every branch first.",
    )
    sampling_scale: float = Field(
        1.0,
        description="`async` only, temperature > 0: Saguaro sampling's C in [0, 1]: the draft samples from "
        "its distribution with the top-F probabilities (F = that depth's fan-out) multiplied by C, which "
        "raises the cache hit rate and lowers acceptance. 1 disables it. Output stays exact for any C.",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v not in (8, 16, 32, 64, 128):
            raise ValueError("must be one of 8, 16, 32, 64, 128")
        return v

    sampling_scale_tokens: Literal["fanout", "fanout+1"] = Field(
        "fanout",
        description="`async` only: which top tokens Saguaro sampling scales by C: the top F (F = that "
        "depth's fan-out, as in the paper) or the top F+1 (as in the authors' code).",
    )

    @field_validator("sampling_scale")
    @classmethod
    def _scale(cls, v: float) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError("must lie in [0, 1] (1 disables Saguaro sampling)")
        return v

    @field_validator("fanout_budget", "max_fanout_budget")
    @classmethod
    def _budget(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= 256:
            raise ValueError("must be between 1 and 256")
        return v

    @field_validator("fanout", "miss_fanout")
    @classmethod
    def _fanout(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (any(f < 0 for f in v) or sum(v) < 1 or sum(v) > 256):
            raise ValueError("needs K+1 non-negative numbers summing to 1..256")
        return v

    @field_validator("kv_cache_gb", "step_timeout_s", "startup_timeout_s")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("max_tokens_per_forward")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 16:
            raise ValueError("must be >= 16")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu"):
            return v
        if v.startswith("cuda:") and v[5:].isdigit():
            return v
        raise ValueError("must be 'auto', 'cpu' or 'cuda:N' (e.g. 'cuda:1')")


class SaguaroConfig(BaseModel):
    """The whole speculative config of `method: "saguaro"`, resolved for the drafter."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["saguaro"]
    model: str = Field(description="The draft model: a local Hugging Face model directory (or a cached HF id).")
    num_speculative_tokens: int = Field(description="K: draft tokens per verification.")
    saguaro: SaguaroOptions = Field(default_factory=SaguaroOptions)

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k(cls, v: int) -> int:
        if not 1 <= v <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"must be between 1 and {MAX_SPECULATIVE_TOKENS}")
        return v

    @model_validator(mode="after")
    def _fanout_lengths(self) -> SaguaroConfig:
        k = self.num_speculative_tokens
        for name in ("fanout", "miss_fanout"):
            value = getattr(self.saguaro, name)
            if value is not None and len(value) != k + 1:
                raise ValueError(
                    f"saguaro.{name} needs K+1 = {k + 1} numbers (one per accepted depth 0..{k}), got "
                    f"{len(value)}: give {k + 1} numbers or remove it for the automatic fan-out"
                )
        return self


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        if not field:  # a check across fields: its message names them
            lines.append(f"speculative_config.{e['msg'].removeprefix('Value error, ')}")
        elif e["type"] == "extra_forbidden":
            owner = SaguaroOptions if len(e["loc"]) > 1 else SaguaroConfig
            allowed = ", ".join(owner.model_fields)
            lines.append(f"speculative_config.{field}: unknown key. Allowed keys here: {allowed}.")
        elif e["type"] == "missing":
            lines.append(f"speculative_config.{field}: required, add it (see docs/configuration.md).")
        else:
            lines.append(f"speculative_config.{field}: {e['msg']} (got {e.get('input')!r}).")
    return "Invalid Saguaro speculative config:\n  " + "\n  ".join(lines)


def parse_saguaro_config(raw: dict[str, Any]) -> SaguaroConfig:
    """Validate the raw speculative-config dict (keys may use '-' or '_')."""
    data = {k.replace("-", "_"): v for k, v in raw.items()}
    try:
        return SaguaroConfig.model_validate(data)
    except ValidationError as err:
        raise SaguaroConfigError(_format_validation_error(err)) from None


def load_speculative_config_arg(value: str) -> dict[str, Any]:
    """`--speculative-config` value: a JSON object, or the path of a JSON file holding one."""
    text = value.strip()
    if not text.startswith("{"):
        path = pathlib.Path(os.path.expanduser(text))
        if not path.is_file():
            raise ValueError(
                f"--speculative-config: {value!r} is neither a JSON object nor an existing JSON file. "
                "Pass inline JSON ('{\"method\": ...}') or the path of a .json file."
            )
        text = path.read_text()
        where = str(path)
    else:
        where = "inline JSON"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--speculative-config: {where} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--speculative-config: {where} must hold a JSON object, not {type(data).__name__}")
    return data
