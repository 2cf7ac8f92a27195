"""Shared test settings: CPU-friendly vLLM defaults and one torch thread in the test process.

Engine processes started by tests inherit these variables. One thread in the pytest process keeps the
small models fast when other processes (vLLM engines, drafters) share the 2 cores.
"""
from __future__ import annotations

import os
import sys

import torch

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

# Engine processes (and the drafter) must be able to import test-only helpers such as tiny_models.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny random Llama target and a noisy copy of it as draft, sharing one tokenizer."""
    from tiny_models import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("tiny-pair"))


@pytest.fixture(scope="session")
def served(tiny_pair, tmp_path_factory) -> dict:
    """The plain, sync and async `vllm serve` runs shared by test_serve_features.py and test_faults.py
    (serve_cases.run_servers): three server start-ups for both files."""
    from serve_cases import run_servers

    return run_servers(tiny_pair, tmp_path_factory.mktemp("serve"))


# ---- tests that hold only on the CPU build of vLLM ------------------------------------------------------------
CPU_BUILD_ONLY_REASON = "holds only on the CPU build of vLLM (this is a CUDA build)"


def vllm_cpu_build() -> bool:
    """Whether vLLM here is its CPU build: its platform, or without vLLM, torch without a GPU. Cached; only
    computed when a test marked `cpu_build_only` runs (importing vLLM's platform takes a few seconds)."""
    global _VLLM_CPU_BUILD
    if _VLLM_CPU_BUILD is None:
        try:
            from vllm.platforms import current_platform

            _VLLM_CPU_BUILD = bool(current_platform.is_cpu())
        except ImportError:
            _VLLM_CPU_BUILD = not torch.cuda.is_available()
    return _VLLM_CPU_BUILD


_VLLM_CPU_BUILD: bool | None = None


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_build_only: holds only on the CPU build of vLLM; skipped (with the "
                            "reason) on a CUDA build")


def pytest_runtest_setup(item):
    if item.get_closest_marker("cpu_build_only") is not None and not vllm_cpu_build():
        pytest.skip(CPU_BUILD_ONLY_REASON)
