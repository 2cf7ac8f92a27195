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


@pytest.fixture(scope="session")
def pair128k(tmp_path_factory):
    """The peaked target and its draft at vocabulary 128256 (real_vocab.py), shared by test_real_vocab.py and
    test_tp.py."""
    from real_vocab import build_peaked_pair

    return build_peaked_pair(tmp_path_factory.mktemp("vocab-128256"), 128256)


@pytest.fixture(scope="session")
def plain128k(pair128k):
    """Plain vLLM (TP=1, no speculation) at vocabulary 128256: the reference of test_real_vocab.py's Saguaro
    engines and of test_tp.py's TP=2 ones (their greedy `b64` and T=1 `t1` jobs are the same jobs)."""
    from engine_runs import run_engine
    from real_vocab import ENGINE, greedy_jobs, t1_job

    return run_engine(pair128k[0], [*greedy_jobs(128256), t1_job(128256)], engine_kwargs={**ENGINE, "seed": 0})


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
