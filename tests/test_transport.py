"""The wire protocol and the client's pure rules, without processes: typed messages round-trip (arrays as raw
frames), anything malformed, oversized or of the wrong direction is rejected with a reason, replies are
checked against their request, and the deadline, restart and resync-backoff rules behave as documented."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import numpy as np
import pytest

from saguaro_vllm.worker.drafter_client import BUSY_CPU_FRACTION
from saguaro_vllm.worker.drafter_policy import Progress, ResyncBackoff, RestartPolicy, StepDeadline, is_working, \
    process_progress
from saguaro_vllm.shared.transport import (
    Channel,
    Failed,
    MessageRejected,
    Ready,
    RowUpdate,
    SamplingSpec,
    Shutdown,
    StepRequest,
    StepResponse,
    ToDrafter,
    ToProposer,
    _Codec,
    check_response,
    new_endpoint,
    rejected_step,
    reply_size_limit,
    sweep_stale_dirs,
)

K, VOCAB = 4, 50


def _request(step=7, k=K):
    return StepRequest(step, [RowUpdate("a", 0, [3, 4, 5], k, SamplingSpec(0.8, 0.9, 20, 1)),
                              RowUpdate("b", 5, [9], k, None)], ["old"], sent_at=1.5)


def _reply(req, **over):
    q = np.full((K, VOCAB), 1.0 / VOCAB, np.float32)
    fields = dict(step=req.step, drafts=[[1, 2, 3, 4], [5]], probs={0: q}, compute_s=0.01, resync=["b"],
                  row_status=["hit", "jit"], row_depth=[2, -1], ssd={"budget": 3, "alpha": 0.5, "skipped": False,
                                                                     "backup": "jit"})
    fields.update(over)
    return StepResponse(**fields)


def _frames(msg) -> list[bytes]:
    return [bytes(f) for f in _Codec(ToProposer).encode(msg)]


def test_messages_round_trip_with_arrays_as_raw_frames():
    req = _request()
    assert _Codec(ToDrafter).decode(_Codec(ToDrafter).encode(req)) == req
    resp = _reply(req)
    frames = _frames(resp)
    assert len(frames) == 2 and len(frames[1]) == K * VOCAB * 4  # the array is one raw frame, not msgpack
    back = _Codec(ToProposer).decode(frames)
    assert back.drafts == resp.drafts and back.ssd == resp.ssd and back.row_status == resp.row_status
    np.testing.assert_array_equal(back.probs[0], resp.probs[0])
    assert back.probs[0].dtype == np.float32
    for msg in (Ready(12, {"cores": [1, 2]}), Failed("boom")):
        assert _Codec(ToProposer).decode(_frames(msg)) == msg
    assert isinstance(_Codec(ToDrafter).decode(_Codec(ToDrafter).encode(Shutdown())), Shutdown)


def _rejected(frames, accepts=ToProposer) -> str:
    with pytest.raises(MessageRejected) as err:
        _Codec(accepts).decode(frames)
    return err.value.reason


def test_malformed_messages_are_rejected_with_a_reason():
    req = _request()
    enc = msgspec.msgpack.encode
    assert _rejected([b"\xc1 not msgpack"]) == "malformed"
    assert _rejected(_frames(_reply(req)), accepts=ToDrafter) == "malformed"  # a reply sent to the drafter
    assert _rejected([enc({"type": "reply", "step": "seven"})]) == "malformed"  # wrong field type
    assert _rejected([enc({"type": "ready", "pid": 1, "info": {}, "extra": 1})]) == "malformed"  # unknown key
    assert _rejected([enc({"type": "pickle", "data": b"x"})]) == "malformed"  # no such message
    bad_row = {"type": "step", "step": 1, "finished": [],
               "rows": [{"req_id": "a", "start": 0, "new_tokens": [-3], "num_drafts": 4}]}
    assert _rejected([enc(bad_row)], accepts=ToDrafter) == "malformed"  # negative token id
    frames = _frames(_reply(req))
    assert _rejected([*frames, b"\0" * 8]) == "frames"  # a frame no header field refers to
    assert _rejected([frames[0], frames[1][:-4]]) == "shape"  # bytes do not match the shape
    assert _rejected(frames[:1]) == "frames"  # the array frame is missing
    assert _rejected(_frames(_reply(req, probs={0: np.zeros((K, VOCAB), np.float64)}))) == "dtype"
    assert rejected_step(enc(bad_row)) == 1  # the drafter can still answer step 1 with an error
    assert rejected_step(b"\xc1") is None and rejected_step(enc({"type": "shutdown"})) is None


def test_channel_rejects_oversized_messages_before_decoding():
    endpoint = new_endpoint()
    a = Channel(endpoint, bind=True, accepts=ToProposer, max_bytes=1 << 16)
    b = Channel(endpoint, bind=False, accepts=ToDrafter)
    try:
        assert b.send(Ready(1, {}), wait_s=5)
        assert isinstance(a.recv(timeout_s=5), Ready)
        assert b.send(Failed("x" * (1 << 17)), wait_s=5)
        with pytest.raises(MessageRejected) as err:
            a.recv(timeout_s=5)
        assert err.value.reason == "oversized"
        assert b.send(_reply(_request()), wait_s=5)
        with pytest.raises(MessageRejected) as err:
            a.recv(timeout_s=5, max_frames=1)
        assert err.value.reason == "frames"
        assert a.recv(timeout_s=0) is None  # rejected messages were consumed
    finally:
        a.close()
        b.close()
        shutil.rmtree(os.path.dirname(endpoint.removeprefix("ipc://")))


def test_check_response_names_what_is_wrong():
    req = _request()
    assert check_response(req, _reply(req), VOCAB) is None
    q = np.full((K, VOCAB), 1.0 / VOCAB, np.float32)
    nan, neg, zero = q.copy(), q.copy(), q.copy()
    nan[1, 2], neg[0, 0], zero[2, 3] = np.nan, -0.1, 0.0  # draft 3 of row 0 is token 3
    cases = {
        "step_id": dict(step=req.step - 1),
        "rows": dict(drafts=[[1]]),
        "draft_length": dict(drafts=[[1, 2, 3, 4, 5], [5]]),
        "token_id": dict(drafts=[[1, 2, 3, VOCAB], [5]]),
        "probs_row": dict(probs={2: q}),
        "probs_shape": dict(probs={0: q[:3]}),
        "row_status": dict(row_status=["hit"]),
        "row_depth": dict(row_depth=[1, 2, 3]),
        "resync": dict(resync=["someone-else"]),
    }
    for reason, over in cases.items():
        assert check_response(req, _reply(req, **over), VOCAB).startswith(reason + ":"), reason
    for bad in (nan, neg, zero):
        assert check_response(req, _reply(req, probs={0: bad}), VOCAB).startswith("probs_value:")
    assert check_response(req, _reply(req, probs={1: q[:1]}), VOCAB) is None  # row 1 has one draft
    assert check_response(req, _reply(req, drafts=[[], []], probs={}), VOCAB) is None


def test_reply_size_limit_admits_every_legitimate_reply():
    req = StepRequest(1, [RowUpdate(f"req-{i:040d}", 0, [1], K) for i in range(64)], [])
    q = np.full((K, VOCAB), 1.0 / VOCAB, np.float32)
    resp = StepResponse(1, [[1] * K] * 64, {j: q for j in range(64)}, 0.0, [r.req_id for r in req.rows],
                        row_status=["ngram"] * 64, row_depth=[K] * 64, ssd={"backup": "x" * 100, "budget": 1})
    frames = _frames(resp)
    max_bytes, max_frames = reply_size_limit(req, VOCAB)
    assert sum(len(f) for f in frames) <= max_bytes and len(frames) <= max_frames


def test_step_deadline_follows_measured_steps_within_floor_and_cap():
    d = StepDeadline(floor_s=1.0, cap_s=30.0, multiple=8.0, warmup_s=10.0, min_samples=8, warmup_steps=2)
    assert d.for_step(5) == 10.0  # nothing measured yet
    for _ in range(20):
        d.observe(0.01, 5)
    assert d.for_step(5) == 1.0  # 8 x 10 ms is below the floor
    for _ in range(20):
        d.observe(0.5, 5)
    assert d.for_step(5) == pytest.approx(4.0)  # 8 x p99
    assert d.for_step(500) == 10.0  # a big step before any per-token measurement
    d.observe(2.0, 1000)  # 2 ms per token
    assert d.for_step(5000) == 30.0  # 8 x 10 s, capped by step_timeout_s
    assert d.for_step(1000) == pytest.approx(16.0)
    d.new_drafter()
    assert d.for_step(5) == 10.0  # a new drafter's first steps
    assert StepDeadline(floor_s=1.0, cap_s=0.5).for_step(1) == 0.5  # step_timeout_s is a hard cap


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_restart_backoff_budget_and_refill():
    clock = Clock()
    p = RestartPolicy(max_restarts=5, backoff_s=1.0, max_backoff_s=4.0, healthy_reset_s=600.0, clock=clock)
    assert [p.next_delay() for _ in range(6)] == [0.0, 1.0, 2.0, 4.0, 4.0, None]  # then disabled
    p = RestartPolicy(max_restarts=3, clock=clock)
    assert p.next_delay() == 0.0 and p.next_delay() == 1.0
    p.on_ready()
    clock.t += 599
    assert not p.refill() and p.count == 2
    clock.t += 2
    assert p.refill() and p.count == 0  # ten healthy minutes: the budget is back
    assert p.next_delay() == 0.0  # and the backoff starts over
    p.on_ready()
    clock.t += 10_000
    assert p.next_delay() == 1.0  # a failure clears the healthy period: no refill for past health
    assert not p.refill()


def test_resync_backoff_holds_a_pathological_request_back_exponentially():
    b = ResyncBackoff(strikes=3, window_steps=64, base_skip=8)
    for step in (1, 2):
        b.on_resync("bad", step)
        assert not b.skip("bad", step + 1)
    b.on_resync("bad", 3)
    assert [b.skip("bad", s) for s in range(4, 13)] == [True] * 8 + [False]  # 8 steps held back
    for step in (12, 13, 14):  # resynced again at once: twice as long
        b.on_resync("bad", step)
    assert all(b.skip("bad", s) for s in range(15, 31)) and not b.skip("bad", 31)
    assert not b.skip("good", 5)
    for step in (1, 100, 200):  # rare resyncs never back off
        b.on_resync("rare", step)
    assert not b.skip("rare", 201)
    b.forget("bad")
    assert not b.skip("bad", 20)


def test_stale_socket_dirs_of_dead_processes_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"saguaro-{dead.pid}-abc"
    live = tmp_path / f"saguaro-{os.getpid()}-def"
    other = tmp_path / "saguaro-notapid"
    for d in (stale, live, other):
        d.mkdir()
    (stale / "drafter.sock").write_text("")
    assert sweep_stale_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
    real_stale = os.path.join(tempfile.gettempdir(), f"saguaro-{dead.pid}-sweepme")
    os.makedirs(real_stale, exist_ok=True)
    endpoint = new_endpoint()  # sweeps the real temp dir the same way before making its own
    path = os.path.dirname(endpoint.removeprefix("ipc://"))
    assert not os.path.exists(real_stale)
    assert os.path.dirname(path) == tempfile.gettempdir()
    assert os.stat(path).st_mode & 0o777 == 0o700 and f"saguaro-{os.getpid()}-" in path
    os.rmdir(path)


def test_process_progress_tells_a_stopped_process_from_a_busy_one():
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        p0 = process_progress(spin.pid)
        time.sleep(0.5)
        p1 = process_progress(spin.pid)
        assert p0.state == "R" and p0.runnable and p1.cpu_s > p0.cpu_s
        assert is_working(p0.cpu_s, p1, 0.5, BUSY_CPU_FRACTION)
        os.kill(spin.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5  # the stop takes effect when the kernel next schedules it
        while process_progress(spin.pid).state != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        p2 = process_progress(spin.pid)
        time.sleep(0.3)
        p3 = process_progress(spin.pid)
        assert p2.state == "T" and not p3.runnable and p3.cpu_s == p2.cpu_s
        assert not is_working(p2.cpu_s, p3, 0.3, BUSY_CPU_FRACTION)
    finally:
        spin.kill()
        spin.wait()
    assert process_progress(spin.pid) is None
    assert not is_working(0.0, None, 1.0, BUSY_CPU_FRACTION)


@pytest.mark.parametrize(("state", "used_s", "runnable", "working"), [
    ("R", 0.5, True, True),     # computing
    ("S", 0.5, False, True),    # computed, now between two kernels
    ("S", 0.0, True, True),     # main thread waits on a worker thread that waits for a CPU
    ("R", 0.001, True, True),   # starved: runnable, no CPU given (an oversubscribed machine), not hung
    ("S", 0.001, False, False),  # asleep and no progress: deadlocked or blocked
    ("D", 0.0, False, False),   # in uninterruptible sleep and no progress
    ("T", 0.0, False, False),   # stopped (SIGSTOP)
    ("t", 0.0, False, False),   # stopped by a debugger
    ("Z", 0.0, False, False),   # dead
])
def test_is_working_tells_starved_from_hung(state, used_s, runnable, working):
    assert is_working(10.0, Progress(state, 10.0 + used_s, runnable), 1.0, BUSY_CPU_FRACTION) is working


def test_a_drafter_starved_of_cpu_is_working_a_sleeping_one_is_not():
    """Real processes: a spinner at SCHED_IDLE beside a normal spinner on the same core gets almost no CPU
    (far under BUSY_CPU_FRACTION) yet is runnable; a process asleep on a pipe is not; a process whose main
    thread waits on a spinning worker thread is runnable through that thread."""
    core = {sorted(os.sched_getaffinity(0))[0]}
    spin = "while True: pass"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    starved = subprocess.Popen([sys.executable, "-c", spin])
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    threaded = subprocess.Popen([sys.executable, "-c", "import threading\n"
                                 "t = threading.Thread(target=lambda: [0 for _ in iter(int, 1)])\nt.start()\nt.join()"])
    try:
        for p in (hog, starved):
            os.sched_setaffinity(p.pid, core)
        os.sched_setscheduler(starved.pid, os.SCHED_IDLE, os.sched_param(0))
        time.sleep(0.5)
        before = {p.pid: process_progress(p.pid) for p in (starved, sleeper, threaded)}
        time.sleep(1.0)
        after = {p.pid: process_progress(p.pid) for p in (starved, sleeper, threaded)}
        s0, s1 = before[starved.pid], after[starved.pid]
        assert s1.cpu_s - s0.cpu_s < BUSY_CPU_FRACTION, "the SCHED_IDLE spinner was not starved"
        assert s1.runnable and is_working(s0.cpu_s, s1, 1.0, BUSY_CPU_FRACTION)
        z0, z1 = before[sleeper.pid], after[sleeper.pid]
        assert z1.state == "S" and not z1.runnable
        assert not is_working(z0.cpu_s, z1, 1.0, BUSY_CPU_FRACTION)
        t1 = after[threaded.pid]
        assert t1.state == "S" and t1.runnable, t1  # the main thread joins; its worker thread spins
    finally:
        for p in (hog, starved, sleeper, threaded):
            p.kill()
            p.wait()
