"""CPU placement: the target worker's threads all end up on the target cores, including threads that
existed before pinning (vLLM's and torch's), and the resolved draft dtype follows the CPU's bf16 support."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from saguaro_vllm.resolve import cpu_has_bf16_matmul

SCRIPT = r"""
import os, threading, time, torch
from saguaro_vllm.placement import pin_process
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads: t.start()
before = {int(t) for t in os.listdir("/proc/self/task")}
stuck = pin_process([0])
late = threading.Thread(target=stop.wait); late.start()
tids = [int(t) for t in os.listdir("/proc/self/task")]
masks = {tid: sorted(os.sched_getaffinity(tid)) for tid in tids}
stop.set()
assert stuck == [], stuck
assert all(m == [0] for m in masks.values()), masks
assert len(before) >= 4 and torch.get_num_threads() == 1
print("ok", len(tids))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or 0 not in os.sched_getaffinity(0),
                    reason="needs core 0 and another core")
def test_pin_process_moves_every_thread():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu avx2 avx512f avx512_bf16", True),
    ("fpu avx2 amx_tile amx_bf16", True),
    ("fpu avx2 avx512f avx512_vnni", False),
    ("", False),
])
def test_bf16_detection_reads_cpu_flags(tmp_path, flags, expected):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_has_bf16_matmul(str(info)) is expected
    assert cpu_has_bf16_matmul(str(tmp_path / "missing")) is False
