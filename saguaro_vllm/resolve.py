"""Front-end checks and placement: turn a validated `SaguaroConfig` into the resolved settings every
engine process receives (through `vllm_config.additional_config["saguaro"]`).

Runs in the process that parses the engine arguments, before any engine process starts, so a bad draft
path, an incompatible vocabulary or an impossible device fails at once with a message naming the field.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from saguaro_vllm.config import SaguaroConfig, SaguaroConfigError

SUPPORTED_DRAFT_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def resolve_draft_path(model: str) -> pathlib.Path:
    """A local HF model dir, or an HF id already in the local hub cache (no download)."""
    path = pathlib.Path(os.path.expanduser(model))
    if not path.exists():
        try:
            from huggingface_hub import snapshot_download

            path = pathlib.Path(snapshot_download(model, local_files_only=True))
        except Exception:
            raise SaguaroConfigError(
                f"speculative_config.model: draft model {model!r} not found. Give a local Hugging Face model "
                "directory (with config.json and *.safetensors) or a hub id already in the local cache."
            ) from None
    if not (path / "config.json").is_file():
        raise SaguaroConfigError(
            f"speculative_config.model: {path} has no config.json; point it at a Hugging Face model directory."
        )
    if not any(path.glob("*.safetensors")):
        raise SaguaroConfigError(
            f"speculative_config.model: {path} has no *.safetensors weights; save the draft with "
            "`save_pretrained(..., safe_serialization=True)`."
        )
    return path.resolve()


def _tokenizer_vocab(model_dir: pathlib.Path) -> dict[str, int] | None:
    tok = model_dir / "tokenizer.json"
    if not tok.is_file():
        return None
    data = json.loads(tok.read_text())
    vocab = dict(data.get("model", {}).get("vocab", {}) or {})
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    return vocab


def check_draft(draft_dir: pathlib.Path, target_model_config: Any) -> dict[str, Any]:
    """Refuse a draft whose architecture is unsupported or whose vocabulary differs from the target's."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_DRAFT_ARCHS for a in archs):
        raise SaguaroConfigError(
            f"speculative_config.model: {draft_dir} is {archs or 'of unknown architecture'}; the drafter "
            f"supports {', '.join(SUPPORTED_DRAFT_ARCHS)}."
        )
    text_cfg = cfg.get("text_config", cfg)
    draft_vocab = int(text_cfg["vocab_size"])
    target_vocab = int(target_model_config.get_vocab_size())
    if draft_vocab != target_vocab:
        raise SaguaroConfigError(
            f"speculative_config.model: the draft's vocabulary ({draft_vocab} tokens, {draft_dir}) differs "
            f"from the target's ({target_vocab}); use a draft trained with the target's tokenizer."
        )
    target_dir = pathlib.Path(str(target_model_config.model))
    target_tok = _tokenizer_vocab(target_dir) if target_dir.is_dir() else None
    draft_tok = _tokenizer_vocab(draft_dir)
    if target_tok is not None and draft_tok is not None and target_tok != draft_tok:
        differing = sum(1 for k, v in draft_tok.items() if target_tok.get(k) != v)
        raise SaguaroConfigError(
            f"speculative_config.model: the draft's tokenizer ({draft_dir}) maps {differing} tokens to "
            "different ids than the target's; use a draft trained with the target's tokenizer."
        )
    return {"vocab_size": draft_vocab, "architecture": archs[0]}


def _parse_cores(env_value: str) -> list[int]:
    cores: list[int] = []
    for part in env_value.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def resolve_cpu_placement(cfg: SaguaroConfig, tp_size: int) -> tuple[list[int], list[int]]:
    """Split this machine's cores between the target worker(s) and the drafter."""
    opts = cfg.saguaro
    available = sorted(os.sched_getaffinity(0))
    for field, cores in (("draft_cores", opts.draft_cores), ("target_cores", opts.target_cores)):
        bad = [c for c in cores or [] if c not in available]
        if bad:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.{field}: cores {bad} are not available to this process "
                f"(available: {available})."
            )
    draft = list(opts.draft_cores or [])
    target = list(opts.target_cores or [])
    user_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if not target and user_bind not in ("auto", "nobind", "") and "|" not in user_bind:
        target = _parse_cores(user_bind)
    if not draft:
        rest = [c for c in available if c not in target] or available
        draft = rest[len(rest) // 2:] if not target else rest
    if not target:
        target = [c for c in available if c not in draft]
    if not target:
        raise SaguaroConfigError(
            "speculative_config.saguaro.draft_cores: leaves no core for the target worker; "
            "give the drafter fewer cores."
        )
    overlap = sorted(set(draft) & set(target))
    if overlap:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.draft_cores: cores {overlap} are also target cores; the drafter must "
            "run on its own cores (set draft_cores and target_cores to disjoint lists)."
        )
    if tp_size > 1:
        raise SaguaroConfigError(
            "speculative_config.saguaro: tensor parallelism on the CPU backend is not supported by the "
            "Saguaro CPU placement yet; use tensor_parallel_size=1."
        )
    return draft, target


def resolve_device(cfg: SaguaroConfig, is_cpu_platform: bool, tp_size: int) -> str:
    device = cfg.saguaro.device
    if is_cpu_platform:
        if device not in ("auto", "cpu"):
            raise SaguaroConfigError(
                f"speculative_config.saguaro.device: {device!r} is not available with the CPU build of vLLM; "
                "use 'cpu' (or 'auto')."
            )
        return "cpu"
    import torch

    count = torch.cuda.device_count()
    if device == "auto":
        if count <= tp_size:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.device: 'auto' needs a free GPU for the drafter, but the target "
                f"uses {tp_size} of {count} GPUs. Set device to 'cuda:N' to share a GPU, or free one."
            )
        return f"cuda:{tp_size}"
    if device == "cpu":
        return "cpu"
    index = int(device.split(":")[1])
    if index >= count:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.device: {device!r} does not exist ({count} CUDA devices visible)."
        )
    return device


def cpu_has_bf16_matmul(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX): then a bf16 draft is much faster
    for the multi-branch steps (measured on these machines, one core, the demo pair's cost-matched draft:
    1/6/13/24 rows per forward take 21/29/38/53 ms in bf16 against 22/51/83/91 ms in fp32)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_for_engine(cfg: SaguaroConfig, target_model_config: Any, tp_size: int,
                       is_cpu_platform: bool) -> dict[str, Any]:
    """Everything the proposer and drafter need, as a plain JSON-able dict; sets the target's CPU binding."""
    draft_dir = resolve_draft_path(cfg.model)
    info = check_draft(draft_dir, target_model_config)
    device = resolve_device(cfg, is_cpu_platform, tp_size)
    draft_cores: list[int] = []
    target_cores: list[int] = []
    if device == "cpu":
        draft_cores, target_cores = resolve_cpu_placement(cfg, tp_size)
        if is_cpu_platform and os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, target_cores))
    dtype = cfg.saguaro.dtype
    if dtype == "auto":
        if device == "cpu":
            dtype = "bfloat16" if cpu_has_bf16_matmul() else "float32"
        else:
            dtype = str(target_model_config.dtype).removeprefix("torch.")
    from saguaro_vllm.drafter.model.linear_kernels import resolve_linear

    try:
        linear = resolve_linear(cfg.saguaro.linear, device, dtype)
    except ValueError as err:
        raise SaguaroConfigError(f"speculative_config.saguaro.linear: {err}.") from None
    resolved = cfg.model_dump()
    resolved["saguaro"]["linear"] = linear
    resolved.update(
        draft_path=str(draft_dir),
        device=device,
        draft_cores=draft_cores,
        target_cores=target_cores if is_cpu_platform else [],
        dtype=dtype,
        vocab_size=info["vocab_size"],
        architecture=info["architecture"],
    )
    return resolved
