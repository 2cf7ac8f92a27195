"""Build hygiene of the saguaro ops: the C++ implementation is active (no silent fallback), every CUDA source
compiles with this machine's nvcc (the .cu files with the toolkit alone, the torch binding `ops_cuda.cpp`
with torch's headers), a failed CUDA build keeps the CPU kernels and is not retried, the loader names what
runs attention, sampling and linear, and the fake kernels give shapes without running anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from saguaro_vllm.ops import loader

CU_FILES = sorted(loader.CSRC.glob("cuda/*.cu"))
# Every CUDA source the build compiles: the .cu kernels and the torch binding.
CUDA_FILES = [loader.CSRC / n for n in loader.CUDA_SOURCES]
# What torch.utils.cpp_extension passes nvcc for a .cu file (COMMON_NVCC_FLAGS, C++20), for one arch.
NVCC_CU_FLAGS = ["-std=c++20", "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                 "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]


def test_cpp_implementation_is_active():
    st = loader.status()
    assert st.loaded, st.error
    assert loader.implementation("cpu") == "cpp"
    if torch.cuda.is_available() and torch.version.cuda:
        assert loader.implementation("cuda") == "cuda"


def test_cu_files_present():
    assert {p.name for p in CU_FILES} >= {"kv_attention.cu", "sampling.cu"}
    assert set(CU_FILES) <= set(CUDA_FILES) and all(p.exists() for p in CUDA_FILES)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_with_toolkit_only(path, tmp_path):
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(path), "-o", str(tmp_path / "out.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("path", CUDA_FILES, ids=lambda p: p.name)
def test_cuda_sources_compile_as_built(path, tmp_path):
    """Each CUDA source, object file only, sm_90, with the flags the build gives it: a .cu file with
    cpp_extension's nvcc flags and no torch headers; `ops_cuda.cpp` through nvcc's host compiler with torch's
    headers, as cpp_extension compiles it (it must need no cuBLAS/cuSPARSE/cuSOLVER headers, which this
    toolkit lacks: the c10 stream API, not ATen/cuda/CUDAContext.h)."""
    from torch.utils.cpp_extension import include_paths

    cmd = ["nvcc", "-arch=sm_90", "-c", str(path), "-o", str(tmp_path / "out.o"), "-I", str(loader.CSRC),
           *loader.CUDA_CFLAGS, "-Xcompiler", "-fPIC"]
    if path.suffix == ".cu":
        cmd += NVCC_CU_FLAGS
    else:
        cmd += ["-std=c++20", "-DTORCH_EXTENSION_NAME=saguaro_ops_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H"]
        for inc in include_paths():
            cmd += ["-isystem", inc]
        torch_inc = Path(include_paths()[0])
        if not (torch_inc / "c10/cuda/impl/cuda_cmake_macros.h").exists():
            # A CPU-only torch ships c10/cuda's headers without this generated one (it only sets export
            # macros for Windows builds); a CUDA torch has it.
            cmd.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "out.o").stat().st_size > 0


def test_binding_uses_the_c10_stream_api():
    text = (loader.CSRC / "cuda/ops_cuda.cpp").read_text()
    assert "ATen/cuda/CUDAContext.h" not in text and "at::cuda::" not in text
    assert "c10::cuda::getCurrentCUDAStream()" in text


def test_loader_names_attention_sampling_linear():
    st = loader.status()
    for dev in ("cpu", "cuda"):
        assert st.implementations[dev] in ("cpp", "cuda", "reference")
        for op in loader.OPS:
            assert f"{op}.{dev}" in st.implementations
    assert loader.active("cpu") == {"attention": "cpp", "sampling": "cpp", "linear": "torch"}
    line = loader.summary("cpu", linear="packed")
    assert "\n" not in line and line.startswith("attention=cpp sampling=cpp linear=packed ("), line
    if not torch.cuda.is_available():
        assert loader.active("cuda")["attention"] == "reference"


def test_triton_attention_is_named(monkeypatch):
    monkeypatch.setenv("SAGUARO_ATTENTION", "triton")
    assert loader.active("cuda")["attention"] == "triton"
    assert loader.active("cpu")["attention"] == "cpp"


def test_cuda_arch_in_the_cache_key(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    assert loader._cuda_arch() == "8.0;9.0"
    srcs = [loader.CSRC / n for n in loader.CPU_SOURCES + loader.CUDA_SOURCES]
    monkeypatch.setattr(loader, "_cuda_arch", lambda: "9.0")
    sm90 = loader._build_dir(srcs, True)
    monkeypatch.setattr(loader, "_cuda_arch", lambda: "8.0")
    assert loader._build_dir(srcs, True) != sm90
    cpu = [loader.CSRC / n for n in loader.CPU_SOURCES]
    assert loader._build_dir(cpu, False) == loader._build_dir(cpu, False)


@pytest.fixture
def failing_cuda_build(monkeypatch, tmp_path):
    """A GPU machine whose CUDA build fails: `_want_cuda` says yes, the CUDA compile step raises (counted),
    the cache is a fresh directory whose CPU build is the one this process already loaded (linked, so
    dlopen sees the same file and nothing registers twice)."""
    real = loader.status()
    assert real.loaded and not real.with_cuda, real
    cpu_dir = Path(real.library).parent
    monkeypatch.setenv("SAGUARO_OPS_CACHE", str(tmp_path))
    monkeypatch.setenv("SAGUARO_OPS", "auto")
    monkeypatch.delenv(loader.RETRY_ENV, raising=False)
    (tmp_path / cpu_dir.name).symlink_to(cpu_dir, target_is_directory=True)
    assert loader._build_dir([loader.CSRC / n for n in loader.CPU_SOURCES], False) == tmp_path / cpu_dir.name
    calls = []

    def compile_(sources, build_dir, with_cuda, name):
        calls.append((with_cuda, name))
        raise RuntimeError(f"Error building extension '{name}': nvcc fatal : simulated")

    monkeypatch.setattr(loader, "_compile", compile_)
    monkeypatch.setattr(loader, "_want_cuda", lambda: True)
    monkeypatch.setattr(loader, "_cuda_arch", lambda: "9.0")

    def fresh_status():  # a new process (a drafter restart): nothing cached in memory, the same disk cache
        monkeypatch.setattr(loader, "_status", None)
        return loader.status()

    return calls, fresh_status, tmp_path


def test_failed_cuda_build_keeps_cpu_kernels_and_is_not_retried(failing_cuda_build, monkeypatch):
    calls, fresh_status, cache = failing_cuda_build
    with pytest.warns(UserWarning, match="CPU kernels are built alone"):
        st = fresh_status()
    assert calls == [(True, "saguaro_ops_cuda")]  # the CPU library was cached: no compile for it
    assert st.loaded and not st.with_cuda and st.error is None and "simulated" in st.cuda_error
    assert st.cuda_arch == "9.0" and Path(st.library).name == "saguaro_ops.so"
    assert st.implementations["cpu"] == "cpp" and st.implementations["cuda"] == "reference"
    assert loader.implementation("cpu") == "cpp" and loader.implementation("cuda") == "reference"
    assert torch.ops.saguaro.cpu_isa() in ("avx512", "avx2", "generic")  # the CPU kernels run
    assert "CUDA build failed, CPU kernels only" in loader.summary("cuda")
    markers = list(cache.glob(f"cuda-*/{loader.CUDA_FAILED}"))
    assert len(markers) == 1 and "simulated" in markers[0].read_text()

    with pytest.warns(UserWarning, match="failed before and is not retried"):
        st = fresh_status()
    assert len(calls) == 1 and st.loaded and loader.implementation("cpu") == "cpp"

    monkeypatch.setenv(loader.RETRY_ENV, "1")  # the documented way to try again
    with pytest.warns(UserWarning, match="simulated"):
        fresh_status()
    assert len(calls) == 2 and len(list(cache.glob(f"cuda-*/{loader.CUDA_FAILED}"))) == 1

    monkeypatch.delenv(loader.RETRY_ENV)
    monkeypatch.setattr(loader, "_cuda_arch", lambda: "10.0")  # another GPU: another key, one new try
    with pytest.warns(UserWarning, match="simulated"):
        fresh_status()
    assert len(calls) == 3 and len(list(cache.glob(f"cuda-*/{loader.CUDA_FAILED}"))) == 2


def test_failed_cuda_build_raises_under_compiled(failing_cuda_build, monkeypatch):
    calls, fresh_status, _ = failing_cuda_build
    monkeypatch.setenv("SAGUARO_OPS", "compiled")
    with pytest.raises(RuntimeError, match="simulated"):
        fresh_status()
    assert len(calls) == 1


def test_sources_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SAGUARO_OPS_SRC", str(tmp_path))
    assert loader.find_sources() == (tmp_path, "SAGUARO_OPS_SRC")
    monkeypatch.delenv("SAGUARO_OPS_SRC")
    path, origin = loader.find_sources()
    assert origin in ("package", "checkout") and (path / "ops.cpp").is_file()


def test_drafter_ready_info_names_the_ops(tiny_pair):
    from saguaro_vllm.drafter.model.loader import read_model_info
    from saguaro_vllm.drafter.server import build_drafter

    cfg = {"draft_path": tiny_pair[1], "device": "cpu", "draft_cores": [], "dtype": "float32",
           "vocab_size": read_model_info(tiny_pair[1]).vocab_size, "num_speculative_tokens": 4,
           "saguaro": {"mode": "sync", "block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 64}}
    _, info = build_drafter(cfg)
    assert info["ops"].startswith(f"attention=cpp sampling=cpp linear={info['linear']} ("), info


def test_fake_kernels_give_shapes():
    loader.status()
    ops = torch.ops.saguaro
    with FakeTensorMode():
        q = torch.empty(5, 8, 64)
        cache = torch.empty(2, 10, 16, 2, 64)
        i32 = torch.empty(5, dtype=torch.int32)
        out = ops.branch_attention(q, cache, torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                   i32, i32, i32, torch.empty(5, 3, dtype=torch.int64), 0.125)
        assert out.shape == (5, 8, 64)
        tok, val = ops.select_candidates(torch.empty(2, 4, 100), torch.empty(2, 3, dtype=torch.int64),
                                         torch.empty(2, 4, dtype=torch.int32), 6)
        assert tok.shape == val.shape == (2, 4, 6) and tok.dtype == torch.int64
        f = torch.empty(3)
        probs = ops.proposal_probs(torch.empty(3, 50), f, torch.empty(3, dtype=torch.int64), f,
                                   torch.empty(3, dtype=torch.int64), f)
        assert probs.shape == (3, 50) and probs.dtype == torch.float32


def test_reference_policy(monkeypatch):
    monkeypatch.setenv("SAGUARO_OPS", "bogus")
    with pytest.raises(ValueError):
        loader._policy()
