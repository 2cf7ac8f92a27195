"""The one loader of the saguaro C++/CUDA ops: builds `csrc/` once into a cache directory and reports
which implementation each device type (and each of attention, sampling, linear) uses.

The sources: `SAGUARO_OPS_SRC` if set, else the package's own copy `saguaro_vllm/csrc/` (package data of a
wheel or a non-editable `pip install .`, found with importlib.resources), else the checkout's top-level
`csrc/` (a source tree or an editable install).

The build directory is keyed by a hash of the sources, the compile flags, the torch/Python versions and,
for a CUDA build, the GPU architectures, so a changed kernel never loads a stale library, and concurrent
processes build it once under a file lock. `SAGUARO_OPS` chooses the policy:

- `auto` (default): build or load the extension; if that fails, warn once and use the plain-torch references.
  If only the CUDA build fails, the CPU kernels are built alone and CUDA tensors use the references.
- `compiled`: build or load, and raise if that fails (tests and benchmarks use this: no silent fallback).
- `reference`: never build; every op runs its plain-torch reference.

`SAGUARO_OPS_CACHE` overrides the cache root (default `~/.cache/saguaro-vllm/ops`). CUDA kernels are built
only when torch has CUDA and a GPU is visible; the CPU kernels are always part of the library. A failed CUDA
build leaves `build-failed.txt` (the error) in its build directory and is not tried again for the same key;
`SAGUARO_OPS_RETRY=1` (or deleting that file) forces a new try.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import sys
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

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
LIB_NAME = "saguaro_ops"  # the CPU library; a CUDA build (CPU + CUDA kernels) is `saguaro_ops_cuda`
#: Left in a CUDA build directory when that build (or loading its library) failed; holds the error.
CUDA_FAILED = "build-failed.txt"
RETRY_ENV = "SAGUARO_OPS_RETRY"
#: What the public ops are: attention (`branch_attention`, `write_kv`, `decode_attention`), sampling
#: (`proposal_probs`, `select_candidates`) and the drafter's linear layers (torch matmuls; `saguaro.linear` picks).
OPS = ("attention", "sampling", "linear")


def find_sources() -> tuple[Path, str]:
    """(directory, origin) of the ops' sources: `SAGUARO_OPS_SRC`, else the installed package's `csrc/`
    (importlib.resources), else the checkout's top-level `csrc/`."""
    override = os.environ.get("SAGUARO_OPS_SRC")
    if override:
        return Path(override), "SAGUARO_OPS_SRC"
    try:
        packaged = importlib.resources.files("saguaro_vllm") / "csrc"
    except (ImportError, TypeError):
        packaged = None
    # A real directory only (a zipped install would need extracting; the compiler needs files).
    if isinstance(packaged, Path) and (packaged / CPU_SOURCES[0]).is_file():
        return packaged, "package"
    return Path(__file__).resolve().parents[2] / "csrc", "checkout"


CSRC, CSRC_ORIGIN = find_sources()


@dataclass
class OpsStatus:
    policy: str
    loaded: bool = False
    with_cuda: bool = False
    library: str | None = None
    error: str | None = None
    build_seconds: float | None = None
    #: "cpu" / "cuda": what the ops run for tensors on that device type ("cpp", "cuda" or "reference"), and
    #: "<op>.<device>" for op in OPS: e.g. "attention.cuda": "triton", "sampling.cpu": "cpp", "linear.cpu": "torch".
    implementations: dict[str, str] = field(default_factory=dict)
    sources: str | None = None  # the csrc directory, and where it was found (`find_sources`)
    cuda_arch: str | None = None  # the GPU architectures of the CUDA build, when one was tried
    cuda_error: str | None = None  # why the CUDA build failed (the CPU kernels then run alone)


_lock = threading.Lock()
_status: OpsStatus | None = None


def _policy() -> str:
    policy = os.environ.get("SAGUARO_OPS", "auto").strip().lower()
    if policy not in ("auto", "compiled", "reference"):
        raise ValueError(f"SAGUARO_OPS must be auto, compiled or reference, got {policy!r}")
    return policy


def _want_cuda() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available()


def _cuda_arch() -> str:
    """The GPU architectures a CUDA build targets, chosen as torch.utils.cpp_extension chooses them:
    `TORCH_CUDA_ARCH_LIST`, else the compute capability of every visible device (e.g. "8.0;9.0")."""
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if listed:
        return listed
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def _cache_root() -> Path:
    return Path(os.environ.get("SAGUARO_OPS_CACHE", Path.home() / ".cache" / "saguaro-vllm" / "ops"))


def _build_dir(sources: list[Path], with_cuda: bool) -> Path:
    h = hashlib.sha256()
    for path in sorted(sources) + sorted(CSRC / n for n in HEADERS if (CSRC / n).exists()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(repr((CFLAGS, LDFLAGS, CUDA_CFLAGS, torch.__version__, torch.version.cuda, sys.version_info[:2],
                   os.environ.get("TORCH_CUDA_ARCH_LIST"))).encode())
    if with_cuda:  # (added for CUDA builds only, so CPU keys, and their cached builds, stay as they were)
        h.update(repr(("cuda", LIB_NAME + "_cuda", _cuda_arch())).encode())
    return _cache_root() / f"{'cuda' if with_cuda else 'cpu'}-{h.hexdigest()[:16]}"


def _compile(sources: list[Path], build_dir: Path, with_cuda: bool, name: str) -> None:
    """Compile and link `sources` into `build_dir/<name>.so` and load it (torch.utils.cpp_extension, ninja)."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=name,
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


def _build_and_load(with_cuda: bool) -> tuple[str, float]:
    import time

    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    sources = [CSRC / n for n in names]
    missing = [str(p) for p in sources if not p.exists()]
    if missing:
        raise FileNotFoundError(f"saguaro ops sources not found: {missing} (set SAGUARO_OPS_SRC)")
    build_dir = _build_dir(sources, with_cuda)
    build_dir.mkdir(parents=True, exist_ok=True)
    # Distinct names: torch.utils.cpp_extension renames a second build under one name in a process to
    # `<name>_v1`, which a CPU build after a failed CUDA build would otherwise be.
    name = LIB_NAME + ("_cuda" if with_cuda else "")
    library = build_dir / f"{name}.so"
    failed = build_dir / CUDA_FAILED
    t0 = time.perf_counter()
    with _file_lock(build_dir / "build.lock"):
        if with_cuda and failed.exists():
            if os.environ.get(RETRY_ENV, "").strip() not in ("", "0"):
                failed.unlink()
            else:
                raise RuntimeError(f"the CUDA build of these sources failed before and is not retried ({failed}; "
                                   f"set {RETRY_ENV}=1 or delete that file to retry): "
                                   f"{failed.read_text(errors='replace')[:4000]}")
        try:
            if library.exists():
                torch.ops.load_library(str(library))
            else:
                _compile(sources, build_dir, with_cuda, name)
        except Exception as exc:
            if with_cuda:  # remembered, so no later process (a drafter restart) pays for the same failure
                failed.write_text(f"{type(exc).__name__}: {exc}"[:20000] + "\n")
            raise
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
        st = OpsStatus(policy=_policy(), sources=f"{CSRC} ({CSRC_ORIGIN})")
        if st.policy != "reference":
            try:
                if _want_cuda():
                    st.cuda_arch = _cuda_arch()
                    try:
                        st.library, st.build_seconds = _build_and_load(True)
                        st.with_cuda = True
                    except Exception as exc:
                        st.cuda_error = f"{type(exc).__name__}: {exc}"
                        if st.policy == "compiled":
                            raise
                        warnings.warn(f"saguaro CUDA ops failed to build or load; the CPU kernels are built alone "
                                      f"and CUDA tensors use the torch references: {st.cuda_error}", stacklevel=2)
                if not st.with_cuda:
                    st.library, st.build_seconds = _build_and_load(False)
                st.loaded = True
                _register_fakes()
            except Exception as exc:
                st.error = f"{type(exc).__name__}: {exc}"
                if st.policy == "compiled":
                    _status = st
                    raise RuntimeError(f"saguaro ops failed to build or load: {st.error}") from exc
                warnings.warn(f"saguaro ops unavailable, using the torch references: {st.error}", stacklevel=2)
        kernels = {
            "cpu": "cpp" if st.loaded else "reference",
            "cuda": "cuda" if st.loaded and st.with_cuda else "reference",
        }
        st.implementations = dict(kernels)
        for dev, kernel in kernels.items():
            st.implementations.update({f"{op}.{dev}": impl for op, impl in _op_implementations(dev, kernel).items()})
        _status = st
        return st


def _op_implementations(dev_type: str, kernel: str) -> dict[str, str]:
    # branch_attention.py: SAGUARO_ATTENTION=triton takes CUDA attention to the Triton kernel. Sampling's plain
    # rows (no top-k/top-p/scaling) use torch's softmax whatever the kernel (proposal.py).
    triton = dev_type == "cuda" and os.environ.get("SAGUARO_ATTENTION") == "triton"
    return {"attention": "triton" if triton else kernel, "sampling": kernel, "linear": "torch"}


def active(device: torch.device | str) -> dict[str, str]:
    """What attention, sampling and linear run on `device`: e.g. {"attention": "cpp", "sampling": "cpp",
    "linear": "torch"} ("linear" is torch's matmuls, whichever path the drafter's `saguaro.linear` picked)."""
    dev_type = torch.device(device).type
    return _op_implementations(dev_type, implementation(device))


def summary(device: torch.device | str = "cpu", linear: str | None = None) -> str:
    """One line for logs (the drafter's Ready info): the implementations on `device` and why any is a fallback,
    e.g. "attention=cpp sampling=cpp linear=packed (saguaro_ops, sources: package)". `linear` names the
    drafter's matmul path where the caller knows it."""
    impl = active(device)
    if linear is not None:
        impl["linear"] = linear
    st = status()

    def short(text: str | None) -> str:  # the first line, at most 160 characters
        line = next(iter((text or "").strip().splitlines()), "")
        return line if len(line) <= 160 else line[:157] + "..."

    if st.policy == "reference":
        notes = ["SAGUARO_OPS=reference"]
    elif not st.loaded:
        notes = [f"ops failed, torch references: {short(st.error)}"]
    else:
        notes = [f"{Path(st.library).stem if st.library else LIB_NAME}, sources: {CSRC_ORIGIN}"]
    if st.cuda_error:
        notes.append(f"CUDA build failed, CPU kernels only: {short(st.cuda_error)}")
    return " ".join(f"{op}={name}" for op, name in impl.items()) + f" ({'; '.join(notes)})"


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
