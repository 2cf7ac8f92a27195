"""The one loader of the saguaro C++/CUDA ops: builds `csrc/` once into a cache directory and reports
which implementation each device type uses.

The build directory is keyed by a hash of the sources, the compile flags and the torch/Python versions, so a
changed kernel never loads a stale library, and concurrent processes build it once under a file lock.
`SAGUARO_OPS` chooses the policy:

- `auto` (default): build or load the extension; if that fails, warn once and use the plain-torch references.
- `compiled`: build or load, and raise if that fails (tests and benchmarks use this: no silent fallback).
- `reference`: never build; every op runs its plain-torch reference.

`SAGUARO_OPS_CACHE` overrides the cache root (default `~/.cache/saguaro-vllm/ops`). CUDA kernels are built
only when torch has CUDA and a GPU is visible; the CPU kernels are always part of the library.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

CSRC = Path(os.environ.get("SAGUARO_OPS_SRC", Path(__file__).resolve().parents[2] / "csrc"))
CPU_SOURCES = ("ops.cpp", "attention_cpu.cpp", "sampling_cpu.cpp")
CUDA_SOURCES = ("cuda/ops_cuda.cpp", "cuda/kv_attention.cu", "cuda/sampling.cu")
HEADERS = ("cpu_common.h", "attention_core.inc", "cuda/saguaro_cuda.h", "cuda/common.cuh")
# Portable flags: no -march=native (the cache may be shared across machines), no fast-math (the sampler's
# tokens must match the reference bit for bit given the same noise).
# -fopenmp: at::parallel_for is an inline `#pragma omp parallel`; without it every CPU kernel runs on one
# thread. The extension then links libgomp.so.1, the runtime torch has already loaded.
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
CUDA_CFLAGS = ["-O3", "-lineinfo"]
LIB_NAME = "saguaro_ops"


@dataclass
class OpsStatus:
    policy: str
    loaded: bool = False
    with_cuda: bool = False
    library: str | None = None
    error: str | None = None
    build_seconds: float | None = None
    implementations: dict[str, str] = field(default_factory=dict)


_lock = threading.Lock()
_status: OpsStatus | None = None


def _policy() -> str:
    policy = os.environ.get("SAGUARO_OPS", "auto").strip().lower()
    if policy not in ("auto", "compiled", "reference"):
        raise ValueError(f"SAGUARO_OPS must be auto, compiled or reference, got {policy!r}")
    return policy


def _want_cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def _build_dir(sources: list[Path], with_cuda: bool) -> Path:
    h = hashlib.sha256()
    for path in sorted(sources) + sorted(CSRC / n for n in HEADERS if (CSRC / n).exists()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, CUDA_CFLAGS, torch.__version__, torch.version.cuda, sys.version_info[:2],
                   os.environ.get("TORCH_CUDA_ARCH_LIST"))).encode())
    root = Path(os.environ.get("SAGUARO_OPS_CACHE", Path.home() / ".cache" / "saguaro-vllm" / "ops"))
    return root / f"{'cuda' if with_cuda else 'cpu'}-{h.hexdigest()[:16]}"


def _build_and_load(with_cuda: bool) -> tuple[str, float]:
    import time

    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    sources = [CSRC / n for n in names]
    missing = [str(p) for p in sources if not p.exists()]
    if missing:
        raise FileNotFoundError(f"saguaro ops sources not found: {missing} (set SAGUARO_OPS_SRC)")
    build_dir = _build_dir(sources, with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / f"{LIB_NAME}.so"
    t0 = time.perf_counter()
    with _file_lock(build_dir / "build.lock"):
        if not library.exists():
            from torch.utils import cpp_extension

            cpp_extension.load(
                name=LIB_NAME,
                sources=[str(p) for p in sources],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                extra_cuda_cflags=CUDA_CFLAGS,
                extra_include_paths=[str(CSRC)],
                build_directory=str(build_dir),
                with_cuda=with_cuda,
                is_python_module=False,
                verbose=os.environ.get("SAGUARO_OPS_VERBOSE") == "1",
            )
        else:
            torch.ops.load_library(str(library))
    return str(library), time.perf_counter() - t0


def _file_lock(path: Path):
    """`filelock.FileLock`, or a plain fcntl lock where filelock is not installed (bare GPU machines)."""
    try:
        from filelock import FileLock

        return FileLock(str(path))
    except ImportError:
        import contextlib
        import fcntl

        @contextlib.contextmanager
        def flock():
            with open(path, "w") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

        return flock()


def status() -> OpsStatus:
    """Load the ops once (per process) according to `SAGUARO_OPS`; return what is active."""
    global _status
    with _lock:
        if _status is not None:
            return _status
        st = OpsStatus(policy=_policy())
        if st.policy != "reference":
            st.with_cuda = _want_cuda()
            try:
                st.library, st.build_seconds = _build_and_load(st.with_cuda)
                st.loaded = True
                _register_fakes()
            except Exception as exc:
                st.error = f"{type(exc).__name__}: {exc}"
                if st.policy == "compiled":
                    _status = st
                    raise RuntimeError(f"saguaro ops failed to build or load: {st.error}") from exc
                warnings.warn(f"saguaro ops unavailable, using the torch references: {st.error}", stacklevel=2)
        st.implementations = {
            "cpu": "cpp" if st.loaded else "reference",
            "cuda": "cuda" if st.loaded and st.with_cuda else "reference",
        }
        _status = st
        return st


def implementation(device: torch.device | str) -> str:
    """`cpp`, `cuda` or `reference`: what the public ops run for tensors on `device`."""
    dev_type = torch.device(device).type
    return status().implementations.get(dev_type, "reference")


def use_compiled(device: torch.device | str) -> bool:
    return implementation(device) != "reference"


_fakes_registered = False


def _register_fakes() -> None:
    """Shape-only kernels so the ops trace under torch.compile / FakeTensor mode."""
    global _fakes_registered
    if _fakes_registered:
        return
    lib = torch.library

    @lib.register_fake("saguaro::write_kv")
    def _write_kv(key, value, kv_cache, slot_mapping):
        return None

    @lib.register_fake("saguaro::branch_attention")
    def _branch_attention(query, kv_cache, block_tables, prefix_lens, owners, depths, steps, branch_slots, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @lib.register_fake("saguaro::select_candidates")
    def _select_candidates(scores, drafted, fanout, max_fanout):
        b, k1, _ = scores.shape
        return (scores.new_empty((b, k1, max_fanout), dtype=torch.int64),
                scores.new_empty((b, k1, max_fanout), dtype=torch.float32))

    @lib.register_fake("saguaro::proposal_probs")
    def _proposal_probs(logits, temperature, top_k, top_p, saguaro_f, log_c):
        return logits.new_empty(logits.shape, dtype=torch.float32)

    _fakes_registered = True
