"""CPU placement of the target worker: keep every thread of it on its own cores, away from the drafter's.

vLLM 0.32 applies `VLLM_CPU_OMP_THREADS_BIND` only to worker processes started by its multiprocessing
executor; with the default single-worker ("uni") executor the worker's OpenMP pool spreads over every core
the process may use (measured: two threads at ~100 % each on a 2-core machine with the binding set to one
core). The drafter would then share its cores with the target and slow every verification down. So the
proposer, which runs in the worker, pins all of the worker's threads to the target cores itself and sizes
torch's thread pool to them. The drafter process pins itself to its own cores (drafter/server.py).
"""
from __future__ import annotations

import os

import torch


def pin_process(cores: list[int]) -> list[int]:
    """Restrict every existing thread of this process (and threads started later by them) to `cores`,
    and use one torch intra-op thread per core. Returns the threads that could not be moved (normally
    none)."""
    wanted = set(cores)
    stuck = []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, wanted)
        except OSError:  # a thread that exited meanwhile, or one we may not move
            stuck.append(tid)
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op after its own binding; the C++ setter
    # below is what that function is bound to.
    torch._C.set_num_threads(len(wanted))
    return stuck


def current_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))
