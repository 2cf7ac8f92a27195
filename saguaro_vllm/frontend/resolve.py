"""Front-end checks and placement: turn a validated `SaguaroConfig` into the resolved settings every
engine process receives (through `vllm_config.additional_config["saguaro"]`).

Runs in the process that parses the engine arguments, before any engine process starts, so a bad draft
path, an incompatible vocabulary or an impossible device fails at once with a message naming the field.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroConfigError
from saguaro_vllm.frontend.cpu_placement import (  # noqa: F401  (names the front end's callers use)
    BIND_SET_BY_US,
    CpuPlacement,
    resolve_cpu_placement,
    split_cores,
    user_bind,
)
from saguaro_vllm.frontend.device_placement import (  # noqa: F401
    RAY_PLACEMENT_FIX,
    RAY_RESERVED,
    own_gpu,
    resolve_devices,
    target_gpus,
)

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


def resolve_device(cfg: SaguaroConfig, is_cpu_platform: bool, tp_size: int, pp_size: int = 1,
                   use_ray: bool = False, gpu_count: int | None = None) -> str:
    """The drafter's device without data parallelism (`device_placement.resolve_devices`)."""
    return resolve_devices(cfg, is_cpu_platform, tp_size, pp_size, 1, use_ray, gpu_count,
                           device_control=os.environ.get("CUDA_VISIBLE_DEVICES"))[0]


def resolve_kv_cache_gb(cfg: SaguaroConfig, device: str, tp_size: int, pp_size: int = 1,
                        use_ray: bool = False, targets: list[list[int]] | None = None) -> float | str:
    """`saguaro.kv_cache_gb` for the drafter: a number stays; `auto` is 1 GiB (kv_cache.AUTO_KV_GIB) on CPU and
    on a GPU the drafter may share with the target (a target GPU, `targets`: default the TP x PP GPUs, or an
    explicit GPU under Ray, where placement is Ray's), and stays "auto" on a GPU of its own (one no target
    uses, or the one Ray reserved for it): the drafter then measures that GPU's free memory after loading the
    draft (kv_cache.kv_budget_bytes)."""
    from saguaro_vllm.drafter.kv_cache import AUTO_KV_GIB

    value = cfg.saguaro.kv_cache_gb
    if value != "auto":
        return value
    if device == RAY_RESERVED or (not use_ray and own_gpu(device, targets or target_gpus(tp_size, pp_size, 1))):
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
                          transport: str = "host", rings: int = 1) -> dict[str, Any]:
    """Where the proposal ring (sampled rows' q, proposal_buffers.py) will go, checked for its worst case.

    Rows: `ring_rows(max_sampled_rows, max_num_seqs)`, the formula the proposer uses (`max_num_seqs` None:
    not known yet, so the cap alone, an upper bound). Requests choose their own temperature, so any engine
    may sample: the ring is needed unless `max_sampled_rows` is 0. Its file is sparse, but a filesystem that
    fills up kills the writer with SIGBUS, so the worst case (every row of both slots written) must fit:
    in /dev/shm, else in the temp dir (a disk-backed file: a start-up warning), else the config is refused,
    naming the size, the space and the fixes. With `transport` "device" the slots are GPU memory and the
    file holds only their header. `rings`: how many engines of this machine hold one each (data-parallel
    ranks), all checked together. Returns `{"dir", "rows", "bytes"}` (dir None: no ring; bytes: one ring)."""
    from saguaro_vllm.shared.proposal_buffers import SHM_DIR, gib, ring_bytes, ring_dir, ring_rows, shortage_message

    k = cfg.num_speculative_tokens
    rows = ring_rows(cfg.saguaro.max_sampled_rows, max_num_seqs if max_num_seqs is not None else 2**31)
    if rows == 0:
        return {"dir": None, "rows": 0, "bytes": 0}
    size = ring_bytes(rows, k, vocab_size) if transport == "host" else ring_bytes(0, k, vocab_size)
    directory, free = ring_dir(size * rings)
    if directory is None:
        many = f" ({rings} data-parallel ranks hold one ring each)" if rings > 1 else ""
        raise SaguaroConfigError(shortage_message(rows, k, vocab_size, free, RING_FIELD) + many + ".")
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
                       use_ray: bool = False, download_dir: str | None = None, dp_size: int = 1,
                       device_ids: list[int] | None = None, ray_legacy: bool = False) -> dict[str, Any]:
    """Everything the proposer and drafter need, as a plain JSON-able dict; sets the target's CPU binding.
    `max_num_seqs`: the engine's (or an upper bound of vLLM's default), which bounds the proposal ring;
    `use_ray`: vLLM's Ray executor runs the workers; `download_dir`: vLLM's, for a draft given as a hub id;
    `dp_size`: the data-parallel ranks this machine runs (one engine and one drafter each); `device_ids`:
    vLLM's `--device-ids`; `ray_legacy`: vLLM 0.32's older Ray executor. Per-rank placement is in `dp_ranks` (one entry per local DP rank; each engine's
    output worker takes its own, `worker/rank_placement.py`); the top-level `device`, `draft_cores`,
    `target_cores` and `target_rank_cores` are DP rank 0's."""
    draft_dir = resolve_draft_path(cfg.model, download_dir, cfg.revision)
    info = check_draft(draft_dir, target_model_config)
    devices = resolve_devices(cfg, is_cpu_platform, tp_size, pp_size, dp_size, use_ray, device_ids=device_ids,
                              device_control=os.environ.get("CUDA_VISIBLE_DEVICES"), ray_legacy=ray_legacy)
    if len({d == "cpu" for d in devices}) > 1:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.devices: mixes CPU and GPU drafters ({devices}); put every data-parallel "
            "rank's drafter on a GPU, or every one on 'cpu'."
        )
    device = devices[0]
    check_draft_attention(draft_dir, device)
    ring = resolve_proposal_ring(cfg, info["vocab_size"], max_num_seqs,
                                 _ring_transport(cfg, device, is_cpu_platform), rings=dp_size)
    world = tp_size * pp_size
    ranks: list[dict[str, Any]] = [{"device": d, "draft_cores": [], "target_rank_cores": []} for d in devices]
    if device == "cpu":
        # A GPU target's ranks are not placed on cores: only the drafters' cores matter there.
        placement = resolve_cpu_placement(cfg, world if is_cpu_platform else 1, dp_size)
        for entry, (draft, rank_cores) in zip(ranks, placement.dp_ranks()):
            entry["draft_cores"] = draft
            entry["target_rank_cores"] = rank_cores if is_cpu_platform else []
        if placement.shared:
            logger.warning("Saguaro: the drafter shares cores %s with the target or another drafter (share_cores): "
                           "both run slower than on cores of their own", placement.shared)
        if is_cpu_platform and user_bind() == "auto":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ[BIND_SET_BY_US] = placement.omp_threads_bind()
    targets = target_gpus(tp_size, pp_size, dp_size) if not (is_cpu_platform or use_ray) else []
    for entry in ranks:
        entry["kv_cache_gb"] = resolve_kv_cache_gb(cfg, entry["device"], tp_size, pp_size, use_ray, targets or None)
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
    resolved["saguaro"]["kv_cache_gb"] = ranks[0]["kv_cache_gb"]
    resolved.update(
        draft_path=str(draft_dir),
        device=device,
        draft_cores=ranks[0]["draft_cores"],
        target_cores=sorted(sum(ranks[0]["target_rank_cores"], [])),
        target_rank_cores=ranks[0]["target_rank_cores"],
        dp_ranks=ranks,
        ray_reserve=device == RAY_RESERVED,  # the worker takes the GPU Ray reserved at executor start
        dtype=dtype,
        vocab_size=info["vocab_size"],
        architecture=info["architecture"],
        proposal_ring_dir=ring["dir"],  # checked here for the ring's worst case; the proposer creates it there
    )
    return resolved
