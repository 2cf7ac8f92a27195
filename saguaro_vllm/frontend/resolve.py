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

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroConfigError

SUPPORTED_DRAFT_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
logger = logging.getLogger("vllm.saguaro")


#: What the drafter reads of a hub repo: configs, tokenizer files, safetensors weights (and their index).
DRAFT_FILES = ["*.json", "*.safetensors", "tokenizer.model"]


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub (and vLLM) read it at import, or as the environment says now."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or now.strip().upper() in ("1", "ON", "YES", "TRUE")


def _is_hub_id(model: str) -> bool:
    if model.startswith(("/", ".", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def _download_lock(model: str, cache_dir: str | None):
    """vLLM's per-model file lock for downloads (concurrent engines fetch a model once), where it has one."""
    try:
        from vllm.model_executor.model_loader.weight_utils import get_lock

        return get_lock(model, cache_dir)
    except Exception:  # vLLM absent or changed: no lock (huggingface_hub locks each file itself)
        import contextlib

        return contextlib.nullcontext()


def download_draft(model: str, download_dir: str | None = None, revision: str | None = None) -> pathlib.Path:
    """The snapshot of hub id `model` (config, tokenizer and safetensors files only), downloaded into the
    Hugging Face cache (or vLLM's `download_dir`) as vLLM downloads the target. Under HF_HUB_OFFLINE=1 only the
    cache is read, never the network."""
    from huggingface_hub import constants, snapshot_download

    offline = _hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    cache = download_dir or constants.HF_HUB_CACHE
    try:
        with _download_lock(model, download_dir):
            return pathlib.Path(snapshot_download(model, revision=revision, cache_dir=download_dir,
                                                  allow_patterns=DRAFT_FILES, local_files_only=offline))
    except Exception as err:
        why = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:300]
        if offline:
            raise SaguaroConfigError(
                f"speculative_config.model: draft model {model!r}{at} is not in the local Hugging Face cache "
                f"({cache}) and HF_HUB_OFFLINE=1 forbids downloading it; download it once with network access "
                f"(`hf download {model}{' --revision ' + revision if revision else ''}`, into that cache), give a "
                "local model directory instead, or unset HF_HUB_OFFLINE."
            ) from None
        raise SaguaroConfigError(
            f"speculative_config.model: could not download draft model {model!r}{at} from the Hugging Face Hub "
            f"into {cache} ({why}); check the id and revision, the network, and HF_TOKEN for a gated or private "
            "model, or give a local model directory."
        ) from None


def resolve_draft_path(model: str, download_dir: str | None = None, revision: str | None = None) -> pathlib.Path:
    """A local HF model directory, or a hub id: downloaded (`download_draft`) unless already cached."""
    path = pathlib.Path(os.path.expanduser(model))
    if not path.exists():
        if not _is_hub_id(model):
            raise SaguaroConfigError(
                f"speculative_config.model: draft model {model!r} not found. Give a local Hugging Face model "
                "directory (with config.json and *.safetensors) or a Hugging Face hub id."
            )
        path = download_draft(model, download_dir, revision)
    elif revision is not None:
        raise SaguaroConfigError(
            f"speculative_config.revision: {model!r} is a local directory, which has no revisions; remove "
            "revision, or give a hub id as model."
        )
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


def _gpu_attention(head_size: int) -> str:
    """The attention implementation of a CUDA drafter, as this process can tell without initialising CUDA:
    "vllm" where the drafter runs vLLM's kernels for every pass (drafter/vllm_attention.py: FlashAttention, else
    vLLM's Triton unified_attention; unless SAGUARO_DRAFT_ATTENTION=saguaro, and only where vLLM has Triton),
    else its own kernels: "triton" (SAGUARO_ATTENTION=triton) or "cuda"."""
    from saguaro_vllm.ops import attention_limits

    mode = os.environ.get("SAGUARO_DRAFT_ATTENTION", "auto").strip().lower() or "auto"
    try:
        from vllm.triton_utils import HAS_TRITON

        from saguaro_vllm.drafter import vllm_attention  # noqa: F401  (the drafter's use of vLLM's kernels)
    except Exception:
        HAS_TRITON = False
    if mode != "saguaro" and HAS_TRITON and attention_limits.unsupported("vllm", 1, 1, head_size) is None:
        return "vllm"
    return "triton" if os.environ.get("SAGUARO_ATTENTION") == "triton" else "cuda"


def check_draft_attention(draft_dir: pathlib.Path, device: str) -> None:
    """Refuse a draft whose attention shape (head size, query heads per KV head) the drafter cannot run on
    `device` (ops/attention_limits.py): no shape runs with query heads that are not a multiple of the KV heads;
    on a GPU the kernel that will run (`_gpu_attention`) must take it (the plain-torch reference there is a
    slow host loop: only with SAGUARO_OPS=reference). On CPU a shape the C++ kernel cannot take runs the
    reference: a warning, not an error."""
    from saguaro_vllm.drafter.model.loader import read_model_info
    from saguaro_vllm.ops import attention_limits

    try:
        info = read_model_info(draft_dir)
    except (ValueError, KeyError) as err:
        raise SaguaroConfigError(f"speculative_config.model: {err}.") from None
    shape = (info.num_heads, info.num_kv_heads, info.head_size)
    described = (f"{info.num_heads} query heads, {info.num_kv_heads} key/value heads, head size "
                 f"{info.head_size}")
    why = attention_limits.unsupported("reference", *shape)
    if why is not None:
        raise SaguaroConfigError(f"speculative_config.model: the draft ({draft_dir}) cannot run in the drafter: its "
                                 f"{why}; use a draft with grouped-query attention whose query heads are a "
                                 "multiple of its key/value heads.")
    if os.environ.get("SAGUARO_OPS", "auto").strip().lower() == "reference":
        return
    if device == "cpu":
        why = attention_limits.unsupported("cpp", *shape)
        if why is not None:
            logger.warning("Saguaro: the drafter's C++ attention cannot run this draft (%s: %s; it runs %s): its "
                           "attention runs the plain-torch reference (slower)", described, why,
                           attention_limits.supported_shapes("cpp"))
        return
    impl = _gpu_attention(info.head_size)
    why = attention_limits.unsupported(impl, *shape)
    if why is not None:
        kernel = {"triton": "Triton attention kernel (SAGUARO_ATTENTION=triton)",
                  "cuda": "CUDA attention kernel"}[impl]
        raise SaguaroConfigError(
            f"speculative_config.model: the drafter's {kernel} on {device} cannot run this draft ({described}: "
            f"{why}; it runs {attention_limits.supported_shapes(impl)}; vLLM's attention kernels, which the "
            f"drafter uses instead where vLLM has Triton, run {attention_limits.supported_shapes('vllm')}). Use a "
            "draft of such a shape, or run the drafter on the CPU (saguaro.device 'cpu'), or set "
            "SAGUARO_OPS=reference to run the plain-torch reference attention on the GPU (much slower)."
        )


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


RAY_PLACEMENT_FIX = (
    "set saguaro.device to a GPU that vLLM's worker of the output rank (TP rank 0, which starts the drafter) "
    "sees, numbered as it sees them (e.g. 'cuda:0' as that worker sees it: the drafter shares its GPU), or "
    "'cpu'; or use the mp executor (--distributed-executor-backend mp), under which 'auto' gives the drafter "
    "the first GPU after the target's."
)


def resolve_device(cfg: SaguaroConfig, is_cpu_platform: bool, tp_size: int, pp_size: int = 1,
                   use_ray: bool = False, gpu_count: int | None = None) -> str:
    """The drafter's device; `auto` on GPUs is the first GPU after the target's TP x PP GPUs. Under vLLM's Ray
    executor (`use_ray`) Ray chooses the workers' GPUs and the drafter inherits the worker's view of them, so
    this process cannot tell which GPU is free: `auto` is refused there, naming how to place the drafter.
    `gpu_count`: the CUDA devices visible (default: torch's count)."""
    device = cfg.saguaro.device
    if is_cpu_platform:
        if device not in ("auto", "cpu"):
            raise SaguaroConfigError(
                f"speculative_config.saguaro.device: {device!r} is not available with the CPU build of vLLM; "
                "use 'cpu' (or 'auto')."
            )
        return "cpu"
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    count = gpu_count
    used = tp_size * pp_size
    if use_ray and device == "auto":
        raise SaguaroConfigError(
            "speculative_config.saguaro.device: 'auto' cannot place the drafter under vLLM's Ray executor "
            "(distributed_executor_backend 'ray'): Ray chooses the target workers' GPUs, and the drafter, started "
            "by a worker, sees the GPUs that worker sees, not those this process sees; " + RAY_PLACEMENT_FIX
        )
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
            f"speculative_config.saguaro.device: {device!r} does not exist ({count} CUDA devices visible)"
            + (f"; under the Ray executor {RAY_PLACEMENT_FIX}" if use_ray else ".")
        )
    return device


def resolve_kv_cache_gb(cfg: SaguaroConfig, device: str, tp_size: int, pp_size: int = 1,
                        use_ray: bool = False) -> float | str:
    """`saguaro.kv_cache_gb` for the drafter: a number stays; `auto` is 1 GiB (kv_cache.AUTO_KV_GIB) on CPU and
    on a GPU the drafter may share with the target (one of its TP x PP GPUs, or any GPU under Ray, where
    placement is Ray's), and stays "auto" on a GPU of its own: the drafter then measures that GPU's free
    memory after loading the draft (kv_cache.kv_budget_bytes)."""
    from saguaro_vllm.drafter.kv_cache import AUTO_KV_GIB

    value = cfg.saguaro.kv_cache_gb
    if value != "auto":
        return value
    if device.startswith("cuda:") and not use_ray and int(device.split(":")[1]) >= tp_size * pp_size:
        return "auto"
    return AUTO_KV_GIB


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
    from saguaro_vllm.shared.proposal_buffers import SHM_DIR, gib, ring_bytes, ring_dir, ring_rows, shortage_message

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
    from saguaro_vllm.shared.proposal_buffers import transport_for

    choice = cfg.saguaro.proposal_transport
    if is_cpu_platform or choice == "host":
        return "host"
    if choice == "device":
        return "device"
    return transport_for("cuda:0", draft_device, peer_access=lambda a, b: True)


def resolve_for_engine(cfg: SaguaroConfig, target_model_config: Any, tp_size: int,
                       is_cpu_platform: bool, pp_size: int = 1, max_num_seqs: int | None = None,
                       use_ray: bool = False, download_dir: str | None = None) -> dict[str, Any]:
    """Everything the proposer and drafter need, as a plain JSON-able dict; sets the target's CPU binding.
    `max_num_seqs`: the engine's (or an upper bound of vLLM's default), which bounds the proposal ring;
    `use_ray`: vLLM's Ray executor runs the workers; `download_dir`: vLLM's, for a draft given as a hub id."""
    draft_dir = resolve_draft_path(cfg.model, download_dir, cfg.revision)
    info = check_draft(draft_dir, target_model_config)
    device = resolve_device(cfg, is_cpu_platform, tp_size, pp_size, use_ray)
    check_draft_attention(draft_dir, device)
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
    from saguaro_vllm.drafter.static_forward import resolve_cuda_graphs

    try:
        cuda_graphs = resolve_cuda_graphs(cfg.saguaro.cuda_graphs, device)
    except ValueError as err:
        raise SaguaroConfigError(f"speculative_config.saguaro.{err}.") from None
    resolved = cfg.model_dump()
    resolved["saguaro"]["linear"] = linear
    resolved["saguaro"]["cuda_graphs"] = cuda_graphs
    resolved["saguaro"]["kv_cache_gb"] = resolve_kv_cache_gb(cfg, device, tp_size, pp_size, use_ray)
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
