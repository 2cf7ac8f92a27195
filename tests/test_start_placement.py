"""A starting drafter is on its own cores and at a lower priority from its first instant, and back at the
worker's priority once loaded (shared/start_placement.py): a replacement loading after a fault must not
compete with the target's steps."""
from __future__ import annotations

import logging
import os
import resource
import subprocess
import sys
import time

import pytest

from saguaro_vllm.drafter.model.loader import read_model_info
from saguaro_vllm.shared import start_placement
from saguaro_vllm.shared.start_placement import LOADING_NICE_STEP, loading_nice, place_started
from saguaro_vllm.worker.drafter_client import DrafterClient
from saguaro_vllm.worker.metrics import SaguaroMetrics


def _thread_nices(pid: int) -> dict[int, int]:
    """Each thread's nice value (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.parametrize("euid, rlimit_nice, own, expected", [
    (0, 0, 0, True),  # root may raise any priority back
    (1000, 0, 0, False),  # the default RLIMIT_NICE (0) allows no raise at all
    (1000, 20, 0, True),  # RLIMIT_NICE 20 allows nice 0 again
    (1000, 15, 0, False),
    (1000, 15, 5, True),  # ... and 15 allows nice 5
    (1000, resource.RLIM_INFINITY, 0, True),
])
def test_may_raise_priority_to(monkeypatch, euid, rlimit_nice, own, expected):
    monkeypatch.setattr(start_placement.os, "geteuid", lambda: euid)
    monkeypatch.setattr(start_placement.resource, "getrlimit", lambda which: (rlimit_nice, rlimit_nice))
    assert start_placement.may_raise_priority_to(own) is expected


def test_no_lower_priority_where_it_could_not_be_undone(monkeypatch):
    monkeypatch.setattr(start_placement, "may_raise_priority_to", lambda nice: False)
    assert loading_nice() is None
    monkeypatch.setattr(start_placement, "may_raise_priority_to", lambda nice: True)
    assert loading_nice() == os.getpriority(os.PRIO_PROCESS, 0)


def test_place_started_then_restore_in_the_child():
    """A real child: moved and lowered by its parent, then restoring every thread itself."""
    last_core = max(os.sched_getaffinity(0))
    own = os.getpriority(os.PRIO_PROCESS, 0)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "sys.stdin.readline()\n"  # wait for the parent's placement
        "t = threading.Thread(target=time.sleep, args=(30,), daemon=True); t.start()\n"  # a thread born lowered
        "from saguaro_vllm.shared.start_placement import restore_priority\n"
        f"print(restore_priority({own}), flush=True)\n"
        "time.sleep(30)\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        restore = loading_nice()
        assert place_started(child.pid, [last_core], restore) == []
        assert os.sched_getaffinity(child.pid) == {last_core}
        lowered = os.getpriority(os.PRIO_PROCESS, child.pid)
        assert lowered == (min(19, own + LOADING_NICE_STEP) if restore is not None else own)
        if restore is None:
            pytest.skip("this process may not raise a priority back: the child is left at its own (tested above)")
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "[]"  # no thread left lowered
        nices = _thread_nices(child.pid)
        assert len(nices) >= 2 and set(nices.values()) == {own}, nices
    finally:
        child.kill()
        child.wait()


def test_a_drafter_starts_on_its_cores_lowered_and_is_ready_at_the_workers_priority(tiny_pair):
    """The real drafter started by the client: on its draft core and lowered before it has imported
    anything, at the worker's priority (every thread) once it says it is ready."""
    last_core = max(os.sched_getaffinity(0))
    own = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = {"draft_path": tiny_pair[1], "device": "cpu", "draft_cores": [last_core], "dtype": "float32",
           "vocab_size": read_model_info(tiny_pair[1]).vocab_size, "num_speculative_tokens": 4,
           "saguaro": {"mode": "sync", "block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 256,
                       "step_timeout_s": 20.0, "startup_timeout_s": 120.0, "log_interval_s": 0,
                       "step_deadline_floor_s": 1.0, "max_restarts": 5}}
    logger = logging.getLogger("test.start_placement")
    client = DrafterClient(cfg, logger, metrics=SaguaroMetrics(cfg, logger))
    try:
        pid = client.proc.pid
        assert os.sched_getaffinity(pid) == {last_core}
        lowered = loading_nice() is not None
        assert os.getpriority(os.PRIO_PROCESS, pid) == (min(19, own + LOADING_NICE_STEP) if lowered else own)
        assert client.wait_ready()
        assert client.info["cores"] == [last_core] and client.info["nice"] == own
        time.sleep(0.1)
        nices = _thread_nices(pid)
        assert len(nices) > 1 and set(nices.values()) == {own}, nices  # torch's pool threads included
        assert all(os.sched_getaffinity(tid) == {last_core} for tid in nices)
    finally:
        client.close()
