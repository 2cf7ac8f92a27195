"""CPU placement: the target worker's threads all end up on the target cores, including threads that
existed before pinning (vLLM's and torch's), and the resolved draft dtype follows the CPU's bf16 support."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from saguaro_vllm.frontend.resolve import cpu_has_bf16_matmul

SCRIPT = r"""
import os, threading, time, torch
from saguaro_vllm.shared.placement import pin_process
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


# ---------------------------------------------------------------- core split between target ranks and drafter

def _placement(monkeypatch, cores: int, world: int, bind: str | None = None, **saguaro):
    """Resolve the placement as on a machine whose process may use cores 0..cores-1."""
    from saguaro_vllm.frontend.config import parse_speculative_config
    from saguaro_vllm.frontend.resolve import resolve_cpu_placement

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    cfg = parse_speculative_config({"method": "saguaro", "model": "d", "num_speculative_tokens": 3,
                                "saguaro": saguaro})[0]
    return resolve_cpu_placement(cfg, world)


def test_tp1_default_split_is_unchanged(monkeypatch):
    p = _placement(monkeypatch, 2, 1)
    assert (p.draft, p.ranks, p.shared) == ([1], [[0]], [])
    assert p.omp_threads_bind() == "0"
    p = _placement(monkeypatch, 3, 1)
    assert (p.draft, p.ranks) == ([1, 2], [[0]])


def test_tp_ranks_get_their_own_cores(monkeypatch):
    p = _placement(monkeypatch, 32, 2)
    assert p.draft == list(range(21, 32)) and p.ranks == [list(range(0, 11)), list(range(11, 21))]
    assert p.omp_threads_bind() == "0,1,2,3,4,5,6,7,8,9,10|11,12,13,14,15,16,17,18,19,20"
    p = _placement(monkeypatch, 16, 4, target_cores=list(range(8)), draft_cores=[8, 9])
    assert p.ranks == [[0, 1], [2, 3], [4, 5], [6, 7]] and p.draft == [8, 9] and p.shared == []


def test_user_binding_with_one_list_per_rank_is_kept(monkeypatch):
    p = _placement(monkeypatch, 8, 2, bind="0-2|3-5")
    assert p.ranks == [[0, 1, 2], [3, 4, 5]] and p.draft == [6, 7]


def test_a_binding_written_by_an_earlier_engine_is_not_taken_for_the_users(monkeypatch):
    # A TP=1 engine in this process wrote '0' (and marked it as ours): a TP=2 engine afterwards re-splits,
    # where the user's own '0' is still an error naming the fix (below).
    monkeypatch.setenv("SAGUARO_SET_OMP_THREADS_BIND", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    from saguaro_vllm.frontend.config import parse_speculative_config
    from saguaro_vllm.frontend.resolve import resolve_cpu_placement

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    cfg = parse_speculative_config({"method": "saguaro", "model": "d", "num_speculative_tokens": 3})[0]
    p = resolve_cpu_placement(cfg, 2)
    assert p.ranks == [[0], [1]] and p.draft == [2, 3]
    monkeypatch.setenv("SAGUARO_SET_OMP_THREADS_BIND", "0,1")
    from saguaro_vllm.frontend.config import SaguaroConfigError

    with pytest.raises(SaguaroConfigError, match="gives 1 core list"):
        resolve_cpu_placement(cfg, 2)


@pytest.mark.parametrize(("cores", "world", "bind", "saguaro", "message"), [
    (2, 2, None, {}, r"saguaro\.share_cores: 2 target rank\(s\) and the drafter need at least 3 cores"),
    (1, 1, None, {}, r"saguaro\.share_cores: 1 target rank\(s\) and the drafter need at least 2 cores"),
    (8, 2, "0-7", {}, r"VLLM_CPU_OMP_THREADS_BIND='0-7' gives 1 core list\(s\) but the target has 2 rank"),
    (8, 2, "0-3|2-5", {}, r"every target rank needs its own non-empty core list"),
    (4, 2, None, {"target_cores": [0]}, r"saguaro\.target_cores: gives 1 core\(s\) for 2 target ranks"),
    (4, 2, None, {"draft_cores": [1, 2, 3]}, r"saguaro\.draft_cores: leaves 1 core\(s\) for 2 target ranks"),
    (4, 1, None, {"draft_cores": [1], "target_cores": [0, 1]}, r"cores \[1\] are also target cores.*share_cores"),
    (4, 1, "0,1", {"target_cores": [2]}, r"target_cores: differs from VLLM_CPU_OMP_THREADS_BIND"),
])
def test_impossible_placements_name_the_field_and_the_fix(monkeypatch, cores, world, bind, saguaro, message):
    from saguaro_vllm.frontend.config import SaguaroConfigError

    with pytest.raises(SaguaroConfigError, match=message):
        _placement(monkeypatch, cores, world, bind, **saguaro)


def test_share_cores_lets_the_drafter_share_a_rank_core(monkeypatch):
    p = _placement(monkeypatch, 2, 2, share_cores=True)
    assert p.ranks == [[0], [1]] and p.draft == [1] and p.shared == [1]
    p = _placement(monkeypatch, 1, 1, share_cores=True)
    assert p.ranks == [[0]] and p.draft == [0] and p.shared == [0]
    p = _placement(monkeypatch, 4, 1, draft_cores=[1], target_cores=[0, 1], share_cores=True)
    assert p.shared == [1]
    assert _placement(monkeypatch, 4, 1, share_cores=True).shared == []  # only where needed


@pytest.mark.parametrize(("count", "tp", "pp", "expected"), [
    (3, 2, 1, "cuda:2"), (5, 2, 2, "cuda:4"), (4, 2, 2, None), (2, 2, 1, None)])
def test_auto_device_counts_tensor_times_pipeline_gpus(monkeypatch, count, tp, pp, expected):
    import torch

    from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
    from saguaro_vllm.frontend.resolve import resolve_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    cfg = parse_speculative_config({"method": "saguaro", "model": "d", "num_speculative_tokens": 3})[0]
    if expected is None:
        with pytest.raises(SaguaroConfigError, match=rf"uses {tp * pp} of {count} GPUs \(tensor parallel {tp} "
                                                     rf"x pipeline parallel {pp}\)"):
            resolve_device(cfg, False, tp, pp)
    else:
        assert resolve_device(cfg, False, tp, pp) == expected
