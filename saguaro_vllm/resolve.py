"""Front-end checks and placement: turn a validated `SaguaroConfig` into the resolved settings every
engine process receives (through `vllm_config.additional_config["saguaro"]`).

Runs in the process that parses the engine arguments, before any engine process starts, so a bad draft
path, an incompatible vocabulary or an impossible device fails at once with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any

from saguaro_vllm.config import SaguaroConfig, SaguaroConfigError

SUPPORTED_DRAFT_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
logger = logging.getLogger("vllm.saguaro")


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


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` contiguous slices, sizes differing by at most one (the first slices larger).

    >>> split_cores([0, 1, 2, 3, 4], 2)
    [[0, 1, 2], [3, 4]]
    """
    size, extra = divmod(len(cores), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(cores[at:at + n])
        at += n
    return out


@dataclasses.dataclass
class CpuPlacement:
    """Cores of the drafter and of each target rank (vLLM's local rank order: pipeline stage, then
    tensor-parallel rank), plus the cores the drafter shares with the target (`share_cores`)."""

    draft: list[int]
    ranks: list[list[int]]
    shared: list[int]

    @property
    def target(self) -> list[int]:
        return sorted(c for cores in self.ranks for c in cores)

    def omp_threads_bind(self) -> str:
        """`VLLM_CPU_OMP_THREADS_BIND` for these ranks: one core list per rank, separated by '|'."""
        return "|".join(",".join(map(str, cores)) for cores in self.ranks)


# The value this plugin last wrote to VLLM_CPU_OMP_THREADS_BIND (an environment variable, so vLLM's engine-core
# and worker processes know it too): a later engine in the same process, perhaps with another TP size, must
# treat it as 'auto', not as the user's own binding.
_BIND_SET_BY_US = "SAGUARO_SET_OMP_THREADS_BIND"


def _user_bind() -> str:
    """The user's `VLLM_CPU_OMP_THREADS_BIND` ('auto' when unset or when it is the value we set)."""
    value = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return "auto" if value == os.environ.get(_BIND_SET_BY_US) else value


def _user_rank_cores(user_bind: str, world: int) -> list[list[int]] | None:
    """The per-rank core lists of an explicit `VLLM_CPU_OMP_THREADS_BIND` (None for auto / nobind)."""
    if user_bind in ("auto", "nobind", ""):
        return None
    lists = user_bind.split("|")
    if len(lists) != world:
        raise SaguaroConfigError(
            f"VLLM_CPU_OMP_THREADS_BIND={user_bind!r} gives {len(lists)} core list(s) but the target has "
            f"{world} rank(s) (tensor x pipeline parallel): give one list per rank separated by '|' "
            "(e.g. '0-15|16-31'), or unset it and use speculative_config.saguaro.target_cores."
        )
    try:
        return [_parse_cores(part) for part in lists]
    except ValueError:
        raise SaguaroConfigError(
            f"VLLM_CPU_OMP_THREADS_BIND={user_bind!r} is not a '|'-separated list of core lists "
            "such as '0-15|16-31'."
        ) from None


def resolve_cpu_placement(cfg: SaguaroConfig, world_size: int = 1) -> CpuPlacement:
    """Split this machine's cores between the target's `world_size` ranks (TP x PP) and the drafter.

    Each rank gets its own cores (`target_cores` split into contiguous slices, or the user's
    '|'-separated `VLLM_CPU_OMP_THREADS_BIND`); the drafter gets `draft_cores`, by default a rank's share
    of the cores (rounded up) from the top. Cores shared between the drafter and a rank are a config error
    unless `share_cores` is set.
    """
    opts = cfg.saguaro
    available = sorted(os.sched_getaffinity(0))
    for field, cores in (("draft_cores", opts.draft_cores), ("target_cores", opts.target_cores)):
        bad = [c for c in cores or [] if c not in available]
        if bad:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.{field}: cores {bad} are not available to this process "
                f"(available: {available})."
            )
    user_ranks = _user_rank_cores(_user_bind(), world_size)
    if user_ranks is not None and opts.target_cores and sorted(sum(user_ranks, [])) != sorted(opts.target_cores):
        raise SaguaroConfigError(
            "speculative_config.saguaro.target_cores: differs from VLLM_CPU_OMP_THREADS_BIND="
            f"{os.environ['VLLM_CPU_OMP_THREADS_BIND']!r}; set only one of them."
        )
    ranks_named = "" if world_size == 1 else f" for {world_size} target ranks (tensor x pipeline parallel)"
    draft = list(opts.draft_cores or [])
    target = list(opts.target_cores or []) or sorted(sum(user_ranks or [], []))
    if not draft:
        rest = [c for c in available if c not in target]
        if target:
            draft = rest or available[-1:]
        else:
            draft = available[len(available) - -(-len(available) // (world_size + 1)):]
    if not target:
        target = [c for c in available if c not in draft]
        if len(target) < world_size and opts.share_cores:
            target = available
    if len(target) < world_size:
        if opts.target_cores or user_ranks:
            field = "target_cores"
            why = f"gives {len(target)} core(s){ranks_named}, each rank needs one"
        elif opts.draft_cores:
            field = "draft_cores"
            why = f"leaves {len(target)} core(s){ranks_named}, each rank needs one; give the drafter fewer cores"
        else:
            field = "share_cores"
            why = (f"{world_size} target rank(s) and the drafter need at least {world_size + 1} cores; "
                   'set "share_cores": true to let the drafter share cores with the target (slower), '
                   "or use fewer ranks")
        raise SaguaroConfigError(
            f"speculative_config.saguaro.{field}: {why} (this process may use {len(available)} cores: "
            f"{available})."
        )
    ranks = user_ranks or split_cores(sorted(target), world_size)
    seen: set[int] = set()
    for cores in ranks:
        if not cores or seen & set(cores):
            raise SaguaroConfigError(
                f"VLLM_CPU_OMP_THREADS_BIND: every target rank needs its own non-empty core list, got {ranks}."
            )
        seen |= set(cores)
    shared = sorted(set(draft) & seen)
    if shared and not opts.share_cores:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.draft_cores: cores {shared} are also target cores{ranks_named} "
            f"(this process may use {available}); the drafter must run on its own cores: set draft_cores and "
            'target_cores to disjoint lists, or set "share_cores": true to let the drafter share them (slower).'
        )
    return CpuPlacement(sorted(draft), ranks, shared)


def resolve_device(cfg: SaguaroConfig, is_cpu_platform: bool, tp_size: int, pp_size: int = 1) -> str:
    """The drafter's device; `auto` on GPUs is the first GPU after the target's TP x PP GPUs."""
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
    used = tp_size * pp_size
    if device == "auto":
        if count <= used:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.device: 'auto' needs a free GPU for the drafter, but the target "
                f"uses {used} of {count} GPUs (tensor parallel {tp_size} x pipeline parallel {pp_size}). "
                "Set device to 'cuda:N' to share a GPU, or free one."
            )
        return f"cuda:{used}"
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


RING_FIELD = "speculative_config.saguaro.max_sampled_rows"


def resolve_proposal_ring(cfg: SaguaroConfig, vocab_size: int, max_num_seqs: int | None,
                          transport: str = "host") -> dict[str, Any]:
    """Where the proposal ring (sampled rows' q, proposal_buffers.py) will go, checked for its worst case.

    Rows: `ring_rows(max_sampled_rows, max_num_seqs)`, the formula the proposer uses (`max_num_seqs` None:
    not known yet, so the cap alone, an upper bound). Requests choose their own temperature, so any engine
    may sample: the ring is needed unless `max_sampled_rows` is 0. Its file is sparse, but a filesystem that
    fills up kills the writer with SIGBUS, so the worst case (every row of both slots written) must fit:
    in /dev/shm, else in the temp dir (a disk-backed file: a start-up warning), else the config is refused,
    naming the size, the space and the fixes. With `transport` "device" the slots are GPU memory and the
    file holds only their header. Returns `{"dir", "rows", "bytes"}` (dir None: no ring)."""
    from saguaro_vllm.proposal_buffers import SHM_DIR, gib, ring_bytes, ring_dir, ring_rows, shortage_message

    k = cfg.num_speculative_tokens
    rows = ring_rows(cfg.saguaro.max_sampled_rows, max_num_seqs if max_num_seqs is not None else 2**31)
    if rows == 0:
        return {"dir": None, "rows": 0, "bytes": 0}
    size = ring_bytes(rows, k, vocab_size) if transport == "host" else ring_bytes(0, k, vocab_size)
    directory, free = ring_dir(size)
    if directory is None:
        raise SaguaroConfigError(shortage_message(rows, k, vocab_size, free, RING_FIELD) + ".")
    if directory != SHM_DIR:
        shm = free.get(SHM_DIR)
        logger.warning(
            "Saguaro: %s cannot hold the proposal ring's worst case (%s for %d rows x K=%d x vocab %d; %s), so "
            "it goes to a file in %s (usually disk-backed: the same memory in the page cache, plus writeback). "
            "Give the container more shared memory (docker run --shm-size=%dg, or --ipc=host) to keep it in "
            "memory, or lower saguaro.max_sampled_rows", SHM_DIR, gib(size), rows, k, vocab_size,
            "not a writable directory" if shm is None else f"{gib(shm)} free", directory,
            -(-size // 2**30) + 1)
    return {"dir": directory, "rows": rows, "bytes": size}


def _ring_transport(cfg: SaguaroConfig, draft_device: str, is_cpu_platform: bool) -> str:
    """The proposal ring's transport as the front end can tell it without initialising CUDA in this process
    (vLLM forks its engine from here): `auto` with a CUDA drafter counts on peer access between the GPUs
    (NVLink or PCIe P2P, the rule on multi-GPU servers); where the proposer finds none it falls back to the
    host ring and checks /dev/shm itself, refusing to start with the same message if it cannot hold it."""
    from saguaro_vllm.proposal_buffers import transport_for

    choice = cfg.saguaro.proposal_transport
    if is_cpu_platform or choice == "host":
        return "host"
    if choice == "device":
        return "device"
    return transport_for("cuda:0", draft_device, peer_access=lambda a, b: True)


def resolve_for_engine(cfg: SaguaroConfig, target_model_config: Any, tp_size: int,
                       is_cpu_platform: bool, pp_size: int = 1, max_num_seqs: int | None = None) -> dict[str, Any]:
    """Everything the proposer and drafter need, as a plain JSON-able dict; sets the target's CPU binding.
    `max_num_seqs`: the engine's (or an upper bound of vLLM's default), which bounds the proposal ring."""
    draft_dir = resolve_draft_path(cfg.model)
    info = check_draft(draft_dir, target_model_config)
    device = resolve_device(cfg, is_cpu_platform, tp_size, pp_size)
    ring = resolve_proposal_ring(cfg, info["vocab_size"], max_num_seqs, _ring_transport(cfg, device, is_cpu_platform))
    draft_cores: list[int] = []
    rank_cores: list[list[int]] = []
    if device == "cpu":
        # A GPU target's ranks are not placed on cores: only the drafter's cores matter there.
        placement = resolve_cpu_placement(cfg, tp_size * pp_size if is_cpu_platform else 1)
        draft_cores, rank_cores = placement.draft, placement.ranks
        if placement.shared:
            logger.warning("Saguaro: the drafter shares cores %s with the target (share_cores): both run "
                           "slower than on cores of their own", placement.shared)
        if is_cpu_platform and _user_bind() == "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ[_BIND_SET_BY_US] = placement.omp_threads_bind()
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
        target_cores=sorted(sum(rank_cores, [])) if is_cpu_platform else [],
        target_rank_cores=rank_cores if is_cpu_platform else [],
        dtype=dtype,
        vocab_size=info["vocab_size"],
        architecture=info["architecture"],
        proposal_ring_dir=ring["dir"],  # checked here for the ring's worst case; the proposer creates it there
    )
    return resolved
