"""The user's interface: the `--speculative-config` JSON, validated into one pydantic model.

```json
{"method": "saguaro", "model": "<draft dir or HF id>", "num_speculative_tokens": 5,
 "saguaro": {"mode": "async", "device": "auto", ...}}
```
Every Saguaro knob lives in the nested `"saguaro"` object (`SaguaroOptions`). The Field descriptions are the
one text of each option: `saguaro-vllm config-doc` writes them into docs/configuration.md. Errors name the field and the fix, and are raised in the front-end process, before
any engine process starts.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PROPOSER_CLASS = "saguaro_vllm.worker.proposer.SaguaroProposer"
ADDITIONAL_CONFIG_KEY = "saguaro"
MAX_SPECULATIVE_TOKENS = 32
#: Options of `mode: "async"` (SSD) only: giving one with `mode: "sync"` is an error, not silently ignored.
ASYNC_ONLY = ("fanout", "fanout_budget", "max_fanout_budget", "miss_fanout", "backup", "finish_predraft",
              "fallback", "sampling_scale", "sampling_scale_tokens", "depth")

#: Options of the drafter process itself: with `drafter_endpoint` the drafter runs on another host and takes
#: them on its own command line (`saguaro-vllm drafter --saguaro '{...}'`), so giving one here is an error.
DRAFTER_HOST_ONLY = ("device", "draft_cores", "share_cores", "dtype", "linear", "block_size", "kv_cache_gb",
                     "proposal_transport", "max_tokens_per_forward", "cuda_graphs", "startup_timeout_s",
                     "max_restarts", "trace_dir", "trace_max_mb")


class SaguaroConfigError(ValueError):
    """A bad Saguaro speculative config; the message names the field and the fix."""


class SaguaroOptions(BaseModel):
    """The nested `"saguaro"` object of the speculative config."""

    # strict: a JSON config says what it means ("5" is not 5, "yes" is not true)
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["sync", "async"] = Field(
        "async",
        description="`async`: speculative speculative decoding (SSD): while the target verifies, the drafter "
        "pre-drafts the likely outcomes, so that on a hit the next drafts are ready at once; "
        "where that cannot pay, rounds are drafted as in `sync` (`fallback`; "
        "[algorithm.md](algorithm.md)). `sync`: after each verification the drafter drafts K "
        "tokens while the target waits; kept for comparison.",
    )
    device: str = Field(
        "auto",
        description="Where the draft model runs: `auto`, `cpu` or `cuda:N`. `auto`: CPU with the CPU build "
        "of vLLM (which accepts only `cpu` and `auto`); on GPUs the first GPU after the target's "
        "TP x PP GPUs (an error if there is none: give `cuda:N` to share one), per DP rank the "
        "first free one after that rank's (or see `devices`); under vLLM's Ray executor a GPU "
        "reserved in its placement group on the output rank's node ([layouts.md](layouts.md)). A "
        "draft whose attention cannot run there is refused "
        "([troubleshooting](troubleshooting.md#gpu-drafters)).",
    )
    devices: list[str] | None = Field(
        None,
        description="With data parallelism: the drafter's device of each local DP rank, in order "
        "(`[\"cuda:4\", \"cuda:5\"]`). Default: from `device`. Two ranks on one GPU, a length other "
        "than the local DP ranks, or a `device` other than `auto` beside it are errors.",
    )
    ray_node: str | None = Field(
        None,
        description="Under vLLM's Ray executor: the node (IP as `ray status` lists it, or Ray node id) where "
        "the output rank (TP rank 0 of the last stage) and so the drafter must run; an engine "
        "whose output rank lands elsewhere is refused. Default: wherever that rank runs. An "
        "error without the Ray executor.",
    )
    draft_cores: list[int] | None = Field(
        None,
        description="CPU only: the cores the drafter is pinned to; with data parallelism split per local DP "
        "rank. Default: one target rank's share of the cores, from the top (the upper half with "
        "one rank), or the cores not in `target_cores`. Must not overlap the target's cores "
        "unless `share_cores` is set.",
    )
    target_cores: list[int] | None = Field(
        None,
        description="CPU only: the cores of the target's ranks, one contiguous slice per rank (DP, then "
        "stage, then TP rank). Sets `VLLM_CPU_OMP_THREADS_BIND` unless you set it yourself. "
        "Default: the cores not given to the drafter.",
    )
    share_cores: bool = Field(
        False,
        description="CPU only: let drafters share cores with the target's ranks (or with each other under "
        "data parallelism) when there are too few cores, e.g. TP=2 on 2 cores; both run slower "
        "(one warning). Without it, overlapping cores are an error naming this field.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Draft weights and KV cache dtype. `auto`: on CPU bfloat16 where the CPU has bf16 "
        "matrix instructions (AVX512-BF16 or AMX), else float32; on GPU the target's dtype. The draft's "
        "precision never affects exactness."
    )
    linear: Literal["auto", "plain", "packed", "onednn", "int8"] = Field(
        "auto", description="The matmul path of the draft's linear layers. `plain`: `F.linear`. `packed` (CPU, "
        "bfloat16): oneDNN with weights pre-packed at load, same numerics. `onednn` (CPU): "
        "vLLM's own CPU GEMM. `int8` (CPU): int8 weights, a slightly different draft (acceptance "
        "may change, output stays exact). `auto`: `packed` for a bf16 CPU drafter where oneDNN's "
        "bf16 path runs, else `onednn` on CPU with vLLM's CPU build, else `plain` "
        "([dev/ops.md](dev/ops.md))."
    )
    block_size: int = Field(16, description="Tokens per block of the drafter's paged KV cache: 8, 16, 32, 64 "
                            "or 128.")
    kv_cache_gb: float | Literal["auto"] = Field(
        "auto", description="Memory of the drafter's KV cache in GiB, > 0, resident from start-up. `auto`: 1 GiB on "
        "CPU, on a GPU shared with the target and on an explicit `cuda:N` under Ray; on a GPU of "
        "its own, half its free memory after loading the draft (`kv_cache_gib` in the `Saguaro "
        "drafter ready` line). A cache that holds no block is an error, fewer tokens than "
        "`max_model_len` a warning. When full, rows that do not fit get no drafts (exact) until "
        "room frees up (`vllm:saguaro_rows_no_room_total`, [metrics.md](metrics.md)).",
    )
    max_sampled_rows: int | Literal["auto"] = Field(
        "auto",
        description="Rows of the proposal ring through which sampled rows' draft probabilities reach vLLM's "
        "rejection sampler: 2 x rows x K x vocab x 4 bytes reserved in `/dev/shm` (else the temp "
        "dir; sparse). Sampled rows beyond it in a step get no drafts (exact; "
        "`vllm:saguaro_sampled_rows_capped_total`). `auto`: min(max_num_seqs, 256). 0: sampled "
        "requests get no drafts, greedy ones do. The worst case must fit "
        "([troubleshooting](troubleshooting.md#the-proposal-ring-shared-memory)).",
    )
    proposal_transport: Literal["auto", "host", "device"] = Field(
        "auto", description="Where the proposal ring lives. `host`: the shared-memory file. `device`: the target "
        "GPU's memory, written by the drafter's GPU over CUDA IPC (2 x rows x K x vocab x 4 "
        "bytes reserved whole; lower `max_sampled_rows` to shrink it); needs a CUDA target and "
        "drafter on one GPU or with peer access. `auto`: `device` where that holds, else `host`.",
    )
    max_tokens_per_forward: int = Field(
        2048, description="Prefill chunk size, >= 16: at most this many tokens of one request per drafter "
        "forward (long prompts are prefilled in chunks)."
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto", description="Run the drafter's one-token forwards as CUDA graphs, one per row bucket (1, 2, 4 ... "
        "2048) captured at start-up; larger forwards run eagerly. The Ready line's `graphs` says "
        "what runs (`cuda-graphs`, `static` or `dynamic`). `auto`: on for a CUDA drafter, off on "
        "CPU. `true` on a CPU drafter is an error.",
    )
    step_timeout_s: float = Field(
        30.0,
        description="Upper bound of the wait for the drafter's answer in one step (the wait itself is derived "
        "from measured step times, see `step_deadline_floor_s`), and the longest a drafter that is still "
        "computing (e.g. a very long prompt) may take before it is restarted. Steps without an answer proceed "
        "with no drafts; output is unaffected.",
    )
    step_deadline_floor_s: float = Field(
        1.0,
        description="Lower bound of the derived per-step wait (8 x the recent p99 of answered steps): a hung "
        "drafter costs one wait of about this long, then it is restarted in the background. Lower it for fast "
        "(GPU) drafters whose steps take milliseconds.",
    )
    max_restarts: int = Field(
        5, description="Drafter restarts (after a crash or hang) allowed before speculation is disabled, "
        "0-1000; the first is immediate, the next wait 1 s, 2 s, 4 s ... (at most 60 s). The budget refills "
        "after 10 minutes of healthy service.",
    )
    startup_timeout_s: float = Field(
        600.0, description="How long vLLM's model loading waits for the first drafter to load; one that cannot "
        "load the draft (bad path or weights) disables speculation at once and logs why."
    )
    log_interval_s: float = Field(10.0, description="Seconds between Saguaro log lines in the worker's log "
                                  "(0 disables them).")
    fanout: list[int] | None = Field(
        None,
        description="`async` only: fixed fan-out per accepted depth 0..K (K+1 numbers summing to 1..256: how "
        "many bonus tokens to pre-draft for \"exactly j drafts accepted\"). Default: computed online from the "
        "measured acceptance rate (geometric allocation) and sized to finish before the verification returns.",
    )
    fanout_budget: int | None = Field(
        None,
        description="`async` only: fixed number of pre-drafted branches per request and round, 1-256 (the "
        "fan-out is spread over the depths automatically). Default: sized from measured drafter step and "
        "verification times. An error together with `fanout`.",
    )
    max_fanout_budget: int = Field(
        128, description="`async` only: upper bound of the automatically sized branches per request and round, "
        "1-256 (the planner sizes the budget from measured costs below it; on a CPU core it stays far below)."
    )
    miss_fanout: list[int] | None = Field(
        None,
        description="`async` only: fixed fan-out per depth (K+1 numbers) for rounds whose drafts came from "
        "the n-gram backup. Default: `fanout` when that is set, else computed online from the backup's own "
        "acceptance estimate.",
    )
    backup: Literal["auto", "jit", "ngram"] = Field(
        "auto",
        description="`async` only: what a speculation-cache miss gets. `jit`: K tokens drafted now (on the "
        "critical path). `ngram`: the tokens that followed an earlier occurrence of the "
        "context's last 1-3 tokens (nearly free, rarely accepted). `auto`: per row, `jit` only "
        "where the tokens it adds are worth the batch's wait, else n-gram "
        "([algorithm.md](algorithm.md#backups)).",
    )
    depth: Literal["fixed", "auto"] = Field(
        "fixed",
        description="`async` only: drafts per row. `fixed`: K (num_speculative_tokens) every step. `auto`: K "
        "is the maximum (start with e.g. 8 to go deeper than 5) and each step uses the depth "
        "with the best estimated tokens per second ([algorithm.md](algorithm.md#depth)).",
    )
    fallback: Literal["auto", "off"] = Field(
        "auto",
        description="`async` only: `auto`: a round whose pre-draft cannot pay is drafted after the "
        "verification exactly as `sync` drafts; the other mode is probed after 16 rounds, the wait doubling "
        "to 64 while probes keep the mode. `off`: "
        "always pre-draft (implied by a fixed `fanout`, `fanout_budget` or `finish_predraft: "
        "true`).",
    )
    finish_predraft: bool = Field(
        False,
        description="`async` only: when an outcome arrives before pre-drafting is done, `false` cuts it "
        "short (branches drafted so far are cached; a hit on a short branch is completed on the spot), "
        "`true` finishes every branch first.",
    )
    sampling_scale: float | Literal["auto"] = Field(
        1.0,
        description="`async` only, temperature > 0: Saguaro sampling's C in [0, 1]: the draft samples from "
        "its distribution with the top-F probabilities (F = that depth's fan-out) multiplied by C, which "
        "raises the cache hit rate and lowers acceptance. 1 disables it. `\"auto\"`: C is chosen per round "
        "of each sampled request from 1, 0.75, 0.5, 0.25 by the measured tokens per second of each, per "
        "temperature. Output stays exact for any C.",
    )

    drafter_endpoint: str | None = Field(
        None,
        description="A drafter on another host: `tcp://HOST:PORT` where `saguaro-vllm drafter --listen "
        "tcp://HOST:PORT --model DRAFT` serves "
        "([layouts.md](layouts.md#a-drafter-on-another-host)). The link is encrypted with "
        "CurveZMQ keys from a shared secret (`drafter_secret_file`); sampled rows' probabilities "
        "cross it (K x vocab x 4 bytes per row and step); while it is down steps get no drafts "
        "and it reconnects. The drafter host's options (device, cores, dtype, KV cache, linear, "
        "CUDA graphs, trace) go to `saguaro-vllm drafter` and are errors here. Default: a local "
        "drafter process.",
    )
    drafter_secret_file: str | None = Field(
        None,
        description="With `drafter_endpoint`: a file holding the secret shared with the remote drafter (at "
        "least 16 bytes; readable by its owner only, mode 600: otherwise an error). Default: the "
        "environment variable `SAGUARO_DRAFTER_SECRET`; one of the two is required.",
    )
    trace_dir: str | None = Field(
        None,
        description="Directory for the drafter's replay trace (off when null): per step and row the outcome, "
        "candidates, pre-drafts and times, as gzipped JSON lines for `saguaro-vllm project` "
        "([projection.md](projection.md)). One file per drafter process.",
    )
    trace_max_mb: float = Field(
        256.0,
        description="Size bound of one trace file in MB (compressed); recording stops with one log line when "
        "it is reached, the run goes on.",
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

    @field_validator("sampling_scale", mode="before")
    @classmethod
    def _scale_kind(cls, v: Any) -> Any:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError("must be a number in [0, 1] (e.g. 0.5) or \"auto\"")
        return v

    @field_validator("sampling_scale")
    @classmethod
    def _scale(cls, v: float | str) -> float | str:
        if v != "auto" and not 0.0 <= v <= 1.0:
            raise ValueError("must lie in [0, 1] (1 disables Saguaro sampling), or be \"auto\"")
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

    @field_validator("step_timeout_s", "startup_timeout_s", "step_deadline_floor_s", "trace_max_mb")
    @classmethod
    def _positive(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be > 0")
        return v

    @field_validator("kv_cache_gb", mode="before")
    @classmethod
    def _kv_cache_gb(cls, v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError("must be a number of GiB > 0 (e.g. 2.0), or \"auto\" (a share of the draft GPU's "
                             "free memory, 1 GiB on CPU)")
        if not 0 < v < float("inf"):
            raise ValueError("must be > 0 (GiB), or \"auto\"")
        return float(v)

    @field_validator("max_restarts")
    @classmethod
    def _restarts(cls, v: int) -> int:
        if not 0 <= v <= 1000:
            raise ValueError("must be between 0 and 1000 (0: never restart a failed drafter)")
        return v

    @field_validator("max_sampled_rows", mode="before")
    @classmethod
    def _sampled_rows(cls, v: Any) -> Any:
        if v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError("must be an integer >= 0 (0: no proposal ring, sampled requests get no drafts) or "
                             "\"auto\"")
        return v

    @field_validator("max_tokens_per_forward")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 16:
            raise ValueError("must be >= 16")
        return v

    @field_validator("drafter_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            from saguaro_vllm.shared.transport import tcp_endpoint

            try:
                tcp_endpoint(v)
            except ValueError:
                raise ValueError("must be a tcp://HOST:PORT endpoint (e.g. tcp://10.0.0.5:5601: a host name or "
                                 "an IP address, and a port 1-65535) where `saguaro-vllm drafter --listen` "
                                 "serves") from None
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v in ("auto", "cpu"):
            return v
        if v.startswith("cuda:") and v[5:].isdigit():
            return v
        raise ValueError("must be 'auto', 'cpu' or 'cuda:N' (e.g. 'cuda:1')")

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must list one device per local data-parallel rank, or be null")
        bad = [d for d in v if not (d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()))]
        if bad:
            raise ValueError(f"entries must be 'cpu' or 'cuda:N' (e.g. 'cuda:4'), got {bad}")
        return v


class SaguaroConfig(BaseModel):
    """The whole speculative config of `method: "saguaro"`, resolved for the drafter."""

    # strict: a JSON config says what it means ("5" is not 5, "yes" is not true)
    model_config = ConfigDict(extra="forbid", strict=True)

    method: Literal["saguaro"] = Field(description="Selects this plugin's proposer (rewritten internally to "
                                       "vLLM's `custom_class` hook).")
    model: str = Field(
        description="The draft model: a local Hugging Face directory (`config.json` + `*.safetensors`), or a "
        "Hugging Face hub id, downloaded by the front end as vLLM downloads models (into the HF cache or vLLM's "
        "`--download-dir`; under `HF_HUB_OFFLINE=1` only the local cache is read, see [troubleshooting]"
        "(troubleshooting.md#the-draft-model-is-not-found-or-cannot-be-downloaded)). Llama (Llama-2/3 family) "
        "and Qwen3 drafts are supported. Its vocabulary must equal the target's (same `vocab_size`; when both "
        "hold a `tokenizer.json`, the same token-to-id map).")
    revision: str | None = Field(
        None, description="vLLM's key for the draft's hub revision (branch, tag or commit) when `model` is a hub "
        "id; an error with a local directory. Default: the main branch.",
    )
    num_speculative_tokens: int = Field(description="K: draft tokens per verification, 1-32.")
    max_model_len: int | None = Field(
        None,
        description="vLLM's key for a draft's maximum length, >= 2: contexts longer than this get no drafts (at "
        "most max_model_len - context tokens near it). At most the target's max_model_len; use it for a draft "
        "trained on shorter contexts than the target. Default: no limit beyond the drafter's KV cache.",
    )
    saguaro: SaguaroOptions = Field(default_factory=SaguaroOptions, description="The Saguaro options below.")

    @field_validator("num_speculative_tokens")
    @classmethod
    def _k(cls, v: int) -> int:
        if not 1 <= v <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"must be between 1 and {MAX_SPECULATIVE_TOKENS}")
        return v

    @field_validator("max_model_len")
    @classmethod
    def _max_len(cls, v: int | None) -> int | None:
        if v is not None and v < 2:
            raise ValueError("must be >= 2 (a context and a draft), or null for no limit")
        return v

    @model_validator(mode="after")
    def _combinations(self) -> SaguaroConfig:
        """Options that contradict each other or would be silently ignored are errors, naming the fix."""
        opts, given = self.saguaro, self.saguaro.model_fields_set
        if opts.mode == "sync":
            for name in ASYNC_ONLY:
                if name in given:
                    raise ValueError(
                        f"saguaro.{name}: only used with mode 'async' (SSD), but mode is 'sync'; set "
                        f"saguaro.mode to 'async', or remove {name}"
                    )
        self._remote()
        k = self.num_speculative_tokens
        for name in ("fanout", "miss_fanout"):
            value = getattr(opts, name)
            if value is not None and len(value) != k + 1:
                raise ValueError(
                    f"saguaro.{name} needs K+1 = {k + 1} numbers (one per accepted depth 0..{k}), got "
                    f"{len(value)}: give {k + 1} numbers or remove it for the automatic fan-out"
                )
        if opts.fanout is not None:
            for name in ("fanout_budget", "max_fanout_budget"):
                if name in given:
                    raise ValueError(f"saguaro.{name}: has no effect when saguaro.fanout is set (the fixed "
                                     f"fan-out fixes the branches); remove {name} or fanout")
        elif opts.fanout_budget is not None and "max_fanout_budget" in given:
            raise ValueError("saguaro.max_fanout_budget: bounds the automatic budget only, and fanout_budget "
                             "fixes it; remove max_fanout_budget or fanout_budget")
        if opts.miss_fanout is not None and opts.backup == "jit":
            raise ValueError("saguaro.miss_fanout: is the fan-out of rounds drafted by the n-gram backup, which "
                             "backup 'jit' never uses; remove miss_fanout or set backup to 'auto' or 'ngram'")
        if opts.devices is not None and opts.device != "auto":
            raise ValueError(f"saguaro.devices: gives each data-parallel rank's device, and saguaro.device "
                             f"({opts.device!r}) one device for all; remove device, or devices")
        if "sampling_scale_tokens" in given and opts.sampling_scale == 1.0:
            raise ValueError("saguaro.sampling_scale_tokens: only used when sampling_scale < 1 (Saguaro "
                             "sampling is off at 1); set sampling_scale below 1 (or \"auto\") or remove "
                             "sampling_scale_tokens")
        return self

    def _remote(self) -> None:
        """A remote drafter (`drafter_endpoint`) takes its host's options on its own command line."""
        opts, given = self.saguaro, self.saguaro.model_fields_set
        if opts.drafter_endpoint is None:
            if "drafter_secret_file" in given:
                raise ValueError("saguaro.drafter_secret_file: only used with saguaro.drafter_endpoint (a drafter "
                                 "on another host); set drafter_endpoint or remove drafter_secret_file")
            return
        for name in DRAFTER_HOST_ONLY:
            if name in given:
                raise ValueError(f"saguaro.{name}: configures the drafter process, which runs on another host with "
                                 f"saguaro.drafter_endpoint; give it to that host's `saguaro-vllm drafter "
                                 f"--saguaro '{{\"{name}\": ...}}'` and remove it here")


#: Readable types for pydantic's type errors: "must be <this>".
_TYPE_NAMES = {
    "int_type": "an integer, e.g. 4", "float_type": "a number, e.g. 0.5", "bool_type": "true or false",
    "string_type": "a string", "list_type": "a JSON list, e.g. [4, 2, 1]",
    "model_type": "a JSON object of Saguaro options", "dict_type": "a JSON object",
}

_JSON_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
               "list": "a list", "dict": "an object", "NoneType": "null"}


def _field_name(loc: tuple) -> str:
    """`("saguaro", "fanout", 1)` -> `saguaro.fanout[1]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _format_error(e: dict) -> str:
    field = _field_name(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if not field:  # a check across fields: its message starts with the field it names
        return f"speculative_config.{msg}."
    if e["type"] == "extra_forbidden":
        owner = SaguaroOptions if len(e["loc"]) > 1 else SaguaroConfig
        allowed = ", ".join(owner.model_fields)
        return f"speculative_config.{field}: unknown key; allowed keys here: {allowed} (docs/configuration.md)."
    if e["type"] == "missing":
        return f"speculative_config.{field}: required; add it (docs/configuration.md)."
    got = e.get("input")
    kind = _JSON_KINDS.get(type(got).__name__, type(got).__name__)
    shown = f"{got!r}" + (f", {kind}" if e["type"] in _TYPE_NAMES else "")
    if e["type"] in _TYPE_NAMES:
        msg = f"must be {_TYPE_NAMES[e['type']]}"
    return f"speculative_config.{field}: {msg.replace('Input should be', 'must be')} (got {shown})."


def _normalized(obj: dict[str, Any], where: str, errors: list[str]) -> dict[str, Any]:
    """Keys with '-' become '_' at every level (`fanout-budget` is `fanout_budget`, as on vLLM's command
    line); the same key given both ways is an error."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in obj.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        if name in out:
            errors.append(f"{where}.{name}: given twice (as {spelled[name]!r} and {key!r}); keep one.")
            continue
        out[name], spelled[name] = value, key
    return out


def parse_speculative_config(raw: dict[str, Any]) -> tuple[SaguaroConfig, dict[str, Any]]:
    """Validate the raw speculative-config dict of `method: "saguaro"`: (the Saguaro config, the vLLM keys
    to pass through to vLLM's own config). Raises one SaguaroConfigError listing every bad field."""
    from saguaro_vllm.frontend.vllm_spec_keys import split_vllm_keys

    errors: list[str] = []
    data = _normalized(raw, "speculative_config", errors)
    if isinstance(data.get(ADDITIONAL_CONFIG_KEY), dict):
        data[ADDITIONAL_CONFIG_KEY] = _normalized(data[ADDITIONAL_CONFIG_KEY], "speculative_config.saguaro", errors)
    data, passed, refused = split_vllm_keys(data)
    errors += refused
    try:
        cfg = SaguaroConfig.model_validate(data)
    except ValidationError as err:
        errors += [_format_error(e) for e in err.errors()]
    if errors:
        raise SaguaroConfigError("Invalid Saguaro speculative config:\n  " + "\n  ".join(errors))
    return cfg, passed


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
