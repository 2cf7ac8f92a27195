"""The drafter client against real processes, without vLLM's engine: a hung drafter costs one bounded wait
and is replaced in the background, a killed one is restarted without any step blocking, malformed replies
cost one step each (counted, logged once), a late but computing drafter is waited out without blocking,
undelivered finished-request lists are kept, a request that keeps resyncing backs off, nothing secret is on
the drafter's command line, and the drafter exits (removing its socket directory) when its parent dies.

The real drafter (tiny model) plays the crashes and hangs; `hostile_drafter.py`, a process speaking the
same protocol, plays a peer that sends malformed or slow replies."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import pytest

from saguaro_vllm.drafter.model.loader import read_model_info
from saguaro_vllm.worker.drafter_client import LATE, READY, RESTARTING, DrafterClient, DrafterUnavailable
from saguaro_vllm.worker.metrics import SaguaroMetrics
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest, endpoint_dir

K = 4
FAST_S = 0.5  # a step that does not wait for the drafter returns within this (incl. launching a replacement: fork+exec on a busy machine)
RECOVERY_S = 60.0  # a replacement drafter loads (fresh Python + torch) in the background


@pytest.fixture(scope="module")
def cfg(tiny_pair):
    return {"draft_path": tiny_pair[1], "device": "cpu", "draft_cores": [], "dtype": "float32",
            "vocab_size": read_model_info(tiny_pair[1]).vocab_size, "num_speculative_tokens": K,
            "saguaro": {"mode": "sync", "block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 256,
                        "step_timeout_s": 20.0, "startup_timeout_s": 120.0, "log_interval_s": 0,
                        "step_deadline_floor_s": 1.0, "max_restarts": 5}}


def _client(cfg, script=None, **opts) -> DrafterClient:
    cfg = {**cfg, "saguaro": {**cfg["saguaro"], **opts}}
    if script is not None:
        cfg["script"] = script
    logger = logging.getLogger("test.drafter_client")
    return DrafterClient(cfg, logger, metrics=SaguaroMetrics(cfg, logger),
                         server_module="hostile_drafter" if script is not None else "saguaro_vllm.drafter.server")


class Steps:
    """Steps of one request (its whole context resent after each restart), timed. Each instance has a request
    id of its own: a context resent from the start for a request the drafter holds is answered with a resync,
    so a test reusing an earlier test's id would begin with an undrafted step."""

    _count = 0

    def __init__(self, client: DrafterClient, sampled: bool = False):
        self.client, self.step, self.sampled = client, 0, sampled
        Steps._count += 1
        self.rid = f"r{Steps._count}"
        self.held_by = None  # the drafter generation that holds the context (as the proposer tracks it)

    def __call__(self):
        """(drafts or the DrafterUnavailable, seconds the step took)."""
        self.step += 1
        start = 3 if self.held_by == self.client.generation else 0
        spec = SamplingSpec(temperature=0.8) if self.sampled else SamplingSpec()
        row = RowUpdate(self.rid, start, [5, 6, 7][start:], K, spec if start == 0 else None)
        t0 = time.monotonic()
        try:
            resp = self.client.step(StepRequest(self.step, [row], []))
            out = resp.drafts[0]
            self.held_by = None if self.rid in resp.resync else self.client.generation
        except DrafterUnavailable as err:
            out = err
            if err.delivered:
                self.held_by = self.client.generation
        return out, time.monotonic() - t0

    def until_drafts(self, timeout_s: float = RECOVERY_S) -> int:
        """Step until drafts come back; every step on the way must return at once. Returns the count."""
        deadline, n = time.monotonic() + timeout_s, 0
        while time.monotonic() < deadline:
            out, took = self()
            n += 1
            if isinstance(out, list) and out:
                return n
            if isinstance(out, DrafterUnavailable):  # (an answered step may take its time: a new drafter)
                assert took < FAST_S, f"a step waited {took:.2f} s for a drafter that is {out.reason}"
            time.sleep(0.02)
        raise AssertionError(f"no drafts within {timeout_s} s (state {self.client.state})")


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# ---- the real drafter ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real(cfg):
    client = _client(cfg)
    started = time.monotonic()
    with pytest.raises(DrafterUnavailable, match="starting"):  # loading never blocks a step
        client.step(StepRequest(1, [RowUpdate("r", 0, [5, 6, 7], K, SamplingSpec())], []))
    assert time.monotonic() - started < FAST_S
    assert client.wait_ready()
    yield client
    procs = [client.proc]
    client.close()
    assert all(p is None or _gone(p.pid, 5) for p in procs), "a drafter outlived its client"


def test_no_config_on_the_command_line(real, cfg):
    cmdline = open(f"/proc/{real.proc.pid}/cmdline").read().split("\0")
    assert not any(cfg["draft_path"] in a or "saguaro" in a and "{" in a for a in cmdline), cmdline
    boot = cmdline[cmdline.index("--bootstrap") + 1]
    socket_dir = endpoint_dir(real.endpoint)
    assert os.path.dirname(boot) == socket_dir and not os.path.exists(boot)  # read, then deleted
    assert os.stat(socket_dir).st_mode & 0o777 == 0o700


def test_a_request_the_drafter_cannot_decode_is_answered_not_waited_for(real):
    steps = Steps(real)
    steps.until_drafts()
    t0, restarts = time.monotonic(), real.restarts
    with pytest.raises(DrafterUnavailable) as err:  # a negative token id: the drafter's decoder refuses it
        real.step(StepRequest(10_000, [RowUpdate("x", 0, [-1], K, SamplingSpec())], []))
    assert err.value.reason == "rejected" and not err.value.delivered and time.monotonic() - t0 < 1.0
    assert real.state == READY and real.restarts == restarts
    assert isinstance(steps()[0], list)


def test_sigkill_restarts_in_the_background_without_blocking(real):
    steps = Steps(real)
    assert steps.until_drafts() == 1
    victim, gen, restarts, old_dir = real.proc.pid, real.generation, real.restarts, endpoint_dir(real.endpoint)
    os.kill(victim, signal.SIGKILL)
    _gone(victim, 5)
    assert steps.until_drafts() > 1  # every step in between returned at once
    assert real.restarts == restarts + 1 and real.generation == gen + 1 and real.proc.pid != victim
    assert not os.path.exists(old_dir)
    snap = real.metrics.snapshot()
    assert snap["restarts"] >= 1 and snap["failures_by_reason"].get("restarting", 0) >= 1


def test_a_hang_costs_one_bounded_wait_then_a_background_restart(real):
    steps = Steps(real)
    steps.until_drafts()
    for _ in range(12):  # enough answered steps for a measured deadline
        assert isinstance(steps()[0], list)
    limit = real.deadline.for_step(0)
    # the tiny drafter answers in milliseconds: the 1 s floor, unless the shared test machine is very busy
    assert limit <= 3.0, f"derived deadline {limit} s"
    victim, restarts = real.proc.pid, real.restarts
    os.kill(victim, signal.SIGSTOP)
    try:
        out, took = steps()
        assert isinstance(out, DrafterUnavailable) and out.reason == "timeout"
        assert limit - 0.05 <= took <= limit + 0.5, (took, limit)
        assert real.state == RESTARTING and real.restarts == restarts + 1
        for _ in range(5):
            out, took = steps()
            assert isinstance(out, DrafterUnavailable) and took < FAST_S
        assert steps.until_drafts() > 1
        assert _gone(victim, 1), "the hung drafter was not killed"
        assert real.proc.pid != victim and real.state == READY
    finally:
        if not _gone(victim, 0):
            os.kill(victim, signal.SIGKILL)


def test_drafter_exits_with_its_parent_and_removes_its_socket_dir(cfg, tmp_path):
    script = textwrap.dedent(f"""
        import logging, sys, time
        from saguaro_vllm.worker.drafter_client import DrafterClient
        c = DrafterClient({cfg!r}, logging.getLogger("parent"))
        assert c.wait_ready()
        from saguaro_vllm.shared.transport import endpoint_dir
        print(c.proc.pid, endpoint_dir(c.endpoint), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid, socket_dir = parent.stdout.readline().split()
        assert os.path.isdir(socket_dir)
        parent.kill()
        parent.wait()
        assert _gone(int(pid), 5), "the drafter outlived its parent"
        deadline = time.monotonic() + 5
        while os.path.exists(socket_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(socket_dir)
    finally:
        if parent.poll() is None:
            parent.kill()


# ---- a hostile peer ------------------------------------------------------------------------------------------
FAULTS = [("wrong_step", "step_id"), ("oov", "token_id"), ("too_many", "draft_length"),
          ("bad_probs_shape", "probs_shape"), ("nan_probs", "probs_value"), ("float64_probs", "dtype"),
          ("unreferenced_frame", "frames"), ("oversized", "oversized"), ("wrong_type", "unexpected"),
          ("garbage", "malformed")]


def test_malformed_replies_mean_no_drafts_counted_and_logged_once(cfg, caplog):
    client = _client(cfg, ["ok"] + [f for f, _ in FAULTS] + ["ok"])
    try:
        assert client.wait_ready()
        steps = Steps(client, sampled=True)
        assert steps()[0] == [1] * K
        with caplog.at_level(logging.INFO, logger="test.drafter_client"):
            for fault, reason in FAULTS:
                out, took = steps()
                assert isinstance(out, DrafterUnavailable) and out.reason == reason, (fault, out)
                assert took < 1.0 and client.state == READY
            assert steps()[0] == [1] * K
        assert client.restarts == 0
        counted = client.metrics.snapshot()["failures_by_reason"]
        assert all(counted.get(reason) == 1 for _, reason in FAULTS), counted
        lines = [r.getMessage() for r in caplog.records]
        assert sum("reply unusable" in m for m in lines) == 1 and sum("valid again" in m for m in lines) == 1
    finally:
        client.close()


def test_a_late_but_computing_drafter_is_waited_out_without_blocking(cfg):
    client = _client(cfg, ["ok"] * 12 + ["busy:2.5", "ok", "busy:60"], step_timeout_s=5.0)
    try:
        assert client.wait_ready()
        steps = Steps(client)
        for _ in range(12):
            assert steps()[0] == [1] * K
        out, took = steps()  # busy 2.5 s: one wait of the derived deadline (the 1 s floor)
        assert isinstance(out, DrafterUnavailable) and out.reason == "timeout" and 0.9 < took < 1.6
        assert client.state == LATE
        assert steps.until_drafts(timeout_s=10) > 1 and client.restarts == 0
        pid = client.proc.pid
        out, took = steps()  # busy for good: killed once step_timeout_s has passed
        assert out.reason == "timeout" and client.state == LATE
        t0 = time.monotonic()
        while client.state == LATE:
            out, took = steps()
            assert took < FAST_S
            time.sleep(0.05)
        assert client.state == RESTARTING and client.restarts == 1 and 3.0 < time.monotonic() - t0 < 6.0
        assert _gone(pid, 3)
    finally:
        client.close()


def _proposer(cfg, script, monkeypatch):
    """A real `SaguaroProposer` (vLLM's config and runner reduced to the fields it reads) whose drafter is
    the hostile one; `sent` records every step request."""
    import saguaro_vllm.worker.proposer as proposer_module

    class HostileClient(DrafterClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, server_module="hostile_drafter", **kwargs)

    monkeypatch.setattr(proposer_module, "DrafterClient", HostileClient)
    vllm_config = types.SimpleNamespace(
        additional_config={"saguaro": {**cfg, "script": script}},
        speculative_config=types.SimpleNamespace(num_speculative_tokens=K),
        model_config=types.SimpleNamespace(get_vocab_size=lambda: cfg["vocab_size"]))
    proposer = proposer_module.SaguaroProposer(vllm_config)
    sent = []
    step = proposer.client.step

    def recording_step(req):
        sent.append(req)
        proposer.last_reply = step(req)
        return proposer.last_reply

    proposer.client.step = recording_step
    return proposer, sent


def _propose(proposer, req_ids: list[str], length: int = 6):
    """One vLLM step of `req_ids`, each with `length` committed tokens."""
    proposer.bind_runner(types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=req_ids), device="cpu",
        requests={r: types.SimpleNamespace(sampling_params=None) for r in req_ids}))
    n = len(req_ids)
    return proposer.propose([[7]] * n, np.full(n, length), np.arange(n * 16).reshape(n, 16) % 50)


def test_finished_ids_survive_steps_the_drafter_cannot_take(cfg, monkeypatch):
    proposer, sent = _proposer(cfg, ["ok"] * 12 + ["busy:2", "echo_finished", "ok_then_disconnect:30", "ok"],
                               monkeypatch)
    try:
        assert proposer.client.wait_ready()
        for _ in range(12):
            assert _propose(proposer, ["a", "b"]) == [[1] * K] * 2
        assert _propose(proposer, ["a", "b"]) == [[], []]  # busy: one bounded wait, then late
        assert proposer.client.state == LATE
        proposer.on_requests_finished(["a"])
        late_steps = 0
        while _propose(proposer, ["b"]) == [[]]:  # until the late answer is in: no request goes out
            assert proposer.finished == ["a"] and proposer.client.state == LATE  # kept, not sent
            late_steps += 1
            time.sleep(0.1)
        assert late_steps > 3 and sent[-1].finished == ["a"] and proposer.finished == []
        assert proposer.last_reply.ssd == {"finished": "a"}  # the drafter got them
        # A drafter that dropped its connection cannot take a step (PAIR sockets do not reconnect): it is
        # replaced, and the new one holds nothing, so the finished list is moot and every row is resent.
        assert _propose(proposer, ["b"]) == [[1] * K]  # answered, then the drafter disconnects
        time.sleep(0.3)
        proposer.on_requests_finished(["b"])
        assert _propose(proposer, ["c"]) == [[]]
        assert proposer.client.restarts == 1 and proposer.finished == []
        assert proposer.metrics.snapshot()["failures_by_reason"]["send"] == 1
        assert proposer.client.wait_ready(30)
        assert _propose(proposer, ["c"]) == [[1] * K] and sent[-1].rows[0].start == 0
    finally:
        proposer.client.close()


def test_a_request_that_keeps_resyncing_backs_off(cfg, monkeypatch):
    proposer, sent = _proposer(cfg, ["resync"], monkeypatch)
    try:
        assert proposer.client.wait_ready()
        for _ in range(24):
            _propose(proposer, ["bad", "good"])
        held = ["bad" in {r.req_id for r in req.rows} for req in sent]
        # sent in 3 steps, held back 8, sent 3 more (resynced at once again), held back 16
        assert held == [True] * 3 + [False] * 8 + [True] * 3 + [False] * 10, held
        assert all("good" in {r.req_id for r in req.rows} for req in sent)
        assert all(r.start == 0 for req in sent for r in req.rows if r.req_id == "bad")
    finally:
        proposer.client.close()


# ---- a poisoned GPU ------------------------------------------------------------------------------------------
def test_a_cuda_error_makes_the_drafter_exit_and_the_client_restart_it(cfg, tmp_path, monkeypatch, caplog):
    """A step that raises a CUDA error (injected: `SAGUARO_DRAFTER_FAIL_FILE` holding "cuda") leaves a GPU
    drafter unusable: the drafter answers that step without drafts and exits with DEVICE_ERROR_EXIT, the client
    restarts it, and once `max_restarts` is spent speculation is disabled with one log line. Any other error is
    answered and the drafter keeps serving."""
    from saguaro_vllm.drafter.server import FAIL_FILE_ENV
    from saguaro_vllm.worker.drafter_client import DISABLED
    from saguaro_vllm.shared.transport import DEVICE_ERROR_EXIT

    fail = tmp_path / "fail"
    monkeypatch.setenv(FAIL_FILE_ENV, str(fail))
    client = _client(cfg, max_restarts=1)
    try:
        with caplog.at_level(logging.INFO, logger="test.drafter_client"):
            assert client.wait_ready()
            steps = Steps(client)
            assert steps.until_drafts() == 1
            fail.write_text("")  # a bug: answered with an error, the drafter keeps serving
            assert steps()[0] == [] and client.state == READY
            first = client.proc
            time.sleep(1.0)
            assert first.poll() is None and client.restarts == 0
            fail.write_text("cuda")
            out, _ = steps()  # answered (no drafts), then the drafter exits
            assert out == [] or isinstance(out, DrafterUnavailable), out
            assert first.wait(timeout=10) == DEVICE_ERROR_EXIT
            fail.unlink()
            assert steps.until_drafts() > 1  # every step on the way returned at once
            assert client.restarts == 1 and client.proc.pid != first.pid and client.state == READY
            fail.write_text("cuda")  # again: the restart budget (1) is spent, speculation is disabled
            second = client.proc
            deadline = time.monotonic() + 20
            while client.state != DISABLED and time.monotonic() < deadline:
                out, took = steps()
                assert took < 5.0
                time.sleep(0.05)
            assert client.state == DISABLED and second.wait(timeout=10) == DEVICE_ERROR_EXIT
        lines = [r.getMessage() for r in caplog.records]
        restarted = [m for m in lines if "restarting it" in m]
        assert len(restarted) == 1 and f"exited with code {DEVICE_ERROR_EXIT} (a CUDA error" in restarted[0], lines
        given_up = [m for m in lines if "WITHOUT speculation" in m]
        assert len(given_up) == 1 and "gave up after 1 restarts (saguaro.max_restarts)" in given_up[0], lines
        assert "CUDA error" in given_up[0]
    finally:
        client.close()
