"""Build hygiene of the saguaro ops: the C++ implementation is active (no silent fallback), every .cu file
compiles with the toolkit alone, and the fake kernels give shapes without running anything."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from saguaro_vllm.ops import loader

CU_FILES = sorted(loader.CSRC.glob("cuda/*.cu"))


def test_cpp_implementation_is_active():
    st = loader.status()
    assert st.loaded, st.error
    assert loader.implementation("cpu") == "cpp"
    if torch.cuda.is_available() and torch.version.cuda:
        assert loader.implementation("cuda") == "cuda"


def test_cu_files_present():
    assert {p.name for p in CU_FILES} >= {"kv_attention.cu", "sampling.cu"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_cu_compiles_with_toolkit_only(path, tmp_path):
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(path), "-o", str(tmp_path / "out.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stderr[-4000:]


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
