"""The proposer's handle on the drafter process: start it, talk to it, restart it, stop it.

Every failure here degrades to "no drafts this step" (`DrafterUnavailable`): vLLM then decodes without
speculation and requests are unaffected. The engine never waits on a drafter that is loading or sick:

    starting --Ready--> ready --dies / hangs--> restarting --Ready--> ready ...
        |                 |  \\--answer late, still computing--> late --answer--> ready
        +--Failed (cannot load the draft) / restart budget spent--> disabled

- One step waits at most `StepDeadline.for_step` (about a second, derived from measured step times, capped
  by `saguaro.step_timeout_s`). A drafter that misses it while using no CPU and with no thread waiting
  for one (stopped, deadlocked) is hung: it gets SIGTERM, SIGKILL a second later, and a replacement starts
  once it is gone. One that is still computing (a long prompt) or runnable but starved of CPU (an
  oversubscribed machine) is `late`: steps go on without drafts, not waiting, until its answer arrives
  (or `step_timeout_s` passes: then it is killed as hung).
- Restarts run in the background: while `starting` / `restarting` every step returns at once without drafts;
  readiness is polled with a zero timeout at each step. A new drafter holds nothing: `generation` bumps
  and the proposer resends every context.
- Backoff and budget: `RestartPolicy` (drafter_policy.py). A draft that fails to load (`Failed`) is
  disabled at once: retrying cannot fix bad weights.
- Every reply is size-checked, decoded as a typed message and checked against its request
  (`transport.check_response`) before use.
- One log line per state change (failed, restarting, late, back, disabled, invalid replies, valid again),
  never one per step; every step without drafts is counted (`vllm:saguaro_drafter_failures_total{reason}`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref

from saguaro_vllm.worker.drafter_policy import Progress, RestartPolicy, StepDeadline, is_working, \
    process_progress
from saguaro_vllm.worker.drafter_states import DISABLED, LATE, READY, RESTARTING, STARTING, STATES  # noqa: F401
from saguaro_vllm.worker.metrics import SaguaroMetrics
from saguaro_vllm.shared.start_placement import loading_nice, place_started
from saguaro_vllm.shared.transport import (
    CONTROL_MAX_BYTES,
    DEVICE_ERROR_EXIT,
    Channel,
    Failed,
    MessageRejected,
    Ready,
    Shutdown,
    StepRequest,
    StepResponse,
    ToProposer,
    check_response,
    endpoint_dir,
    new_endpoint,
    reply_size_limit,
)

SERVER_MODULE = "saguaro_vllm.drafter.server"
KILL_GRACE_S = 1.0  # SIGTERM -> SIGKILL
BUSY_CPU_FRACTION = 0.02  # less CPU than this share of a second, with no runnable thread: hung
RECV_SLICE_S = 0.05  # how often a waiting step checks that the drafter process still lives


class DrafterUnavailable(RuntimeError):
    """The drafter cannot answer this step; the caller proposes no drafts.

    `reason` is a short label (the failure counter's); `delivered` says whether the drafter got the request
    (if not, the caller keeps what it meant to send, e.g. the finished-request list)."""

    def __init__(self, reason: str, detail: str = "", delivered: bool = False):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.delivered = reason, delivered


class _Processes:
    """Every drafter process of one client and its socket directory, stopped together at exit."""

    def __init__(self):
        self.procs: dict[subprocess.Popen, str] = {}

    def stop_all(self) -> None:
        for proc in list(self.procs):
            if proc.poll() is None:
                proc.terminate()
                _signal(proc, signal.SIGCONT)
        for proc, socket_dir in list(self.procs.items()):
            try:
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=3)
            shutil.rmtree(socket_dir, ignore_errors=True)
        self.procs.clear()


def _exited(code: int) -> str:
    """How the log names a drafter's exit: its status, and what the drafter's own status means."""
    if code == DEVICE_ERROR_EXIT:
        return (f"exited with code {code} (a CUDA error left its GPU unusable; the drafter's log has the "
                "traceback)")
    return f"exited with code {code}"


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


class DrafterClient:
    def __init__(self, cfg: dict, logger, metrics: SaguaroMetrics | None = None, vocab_size: int | None = None,
                 server_module: str = SERVER_MODULE, clock=time.monotonic):
        self.cfg = cfg
        self.logger = logger
        self.metrics = metrics if metrics is not None else SaguaroMetrics(cfg, logger)
        self.vocab_size = int(vocab_size or cfg["vocab_size"])
        self.server_module = server_module
        self.clock = clock
        opts = cfg["saguaro"]
        self.step_timeout_s = float(opts["step_timeout_s"])
        self.startup_timeout_s = float(opts["startup_timeout_s"])
        self.deadline = StepDeadline(floor_s=float(opts.get("step_deadline_floor_s", 1.0)),
                                     cap_s=self.step_timeout_s)
        self.policy = RestartPolicy(max_restarts=int(opts.get("max_restarts", 5)), clock=clock)
        self.state = STARTING
        self.generation = 1  # bumped whenever the drafter's state is lost: request contexts must be resent
        self.restarts = 0
        self.disabled_reason: str | None = None
        self.info: dict = {}
        self.proc: subprocess.Popen | None = None
        self.chan: Channel | None = None
        self.endpoint: str | None = None
        self._started_at = self._failed_at = 0.0
        self._restart_at: float | None = None
        self._dying: dict[subprocess.Popen, float] = {}  # process -> when to SIGKILL it
        self._late: dict | None = None  # the step whose answer is late
        self._late_resync: list[str] = []
        self._invalid: str | None = None  # the reason of the last invalid reply, until a valid one
        self._procs = _Processes()
        self._finalizer = weakref.finalize(self, self._procs.stop_all)
        self._set_state(STARTING)
        self._start()

    # ---- processes --------------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._restart_at = None
        self.endpoint = new_endpoint()
        socket_dir = endpoint_dir(self.endpoint)
        self.chan = Channel(self.endpoint, bind=True, accepts=ToProposer)
        bootstrap = os.path.join(socket_dir, "bootstrap.json")
        cores = (self.cfg.get("draft_cores") or []) if self.cfg.get("device") == "cpu" else []
        restore_nice = loading_nice()
        fd = os.open(bootstrap, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"endpoint": self.endpoint, "parent_pid": os.getpid(), "config": self.cfg,
                       "restore_nice": restore_nice}, f)
        env = dict(os.environ)
        # The drafter must not inherit the target worker's OpenMP binding or thread count.
        for key in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", self.server_module, "--bootstrap", bootstrap]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        self._procs.procs[self.proc] = socket_dir
        for problem in place_started(self.proc.pid, cores, restore_nice):
            self.logger.debug("Saguaro: drafter (pid %d) start placement: %s", self.proc.pid, problem)
        self._started_at = self.clock()

    def _retire(self) -> None:
        """Stop the current process without waiting: SIGTERM now (and SIGCONT, so a stopped process can
        act on it), SIGKILL after KILL_GRACE_S; its replacement starts only once it is gone."""
        if self.chan is not None:
            self.chan.close()
        if self.proc is not None:
            shutil.rmtree(self._procs.procs.get(self.proc, ""), ignore_errors=True)
            if self.proc.poll() is None:
                _signal(self.proc, signal.SIGTERM)
                _signal(self.proc, signal.SIGCONT)
                self._dying[self.proc] = self.clock() + KILL_GRACE_S
            else:
                self._procs.procs.pop(self.proc, None)
        self.proc = self.chan = None
        self._late = None

    def _gone(self) -> str | None:
        """How the drafter went away (its exit status), or None while it is there."""
        code = self.proc.poll()
        return None if code is None else _exited(code)

    def _probe(self) -> Progress | None:
        """The drafter process's run state, CPU seconds and runnable threads (`process_progress`)."""
        return process_progress(self.proc.pid)

    def _reap(self) -> None:
        now = self.clock()
        for proc, kill_at in list(self._dying.items()):
            if proc.poll() is not None:
                del self._dying[proc]
                self._procs.procs.pop(proc, None)
            elif now >= kill_at:
                proc.kill()

    # ---- state changes ------------------------------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        self.state = state
        self.metrics.on_drafter_state(state)

    def _lost(self, reason: str) -> None:
        """The drafter's state is gone (it died, hung or spoke nonsense): restart it after the backoff."""
        pid = self.proc.pid if self.proc is not None else None
        self._retire()
        self.generation += 1
        self._failed_at = self.clock()
        delay = self.policy.next_delay()
        if delay is None:
            self._disable(f"drafter (pid {pid}) {reason}; gave up after {self.policy.max_restarts} restarts "
                          f"(saguaro.max_restarts)")
            return
        self.restarts += 1
        self.metrics.on_drafter_restart()
        self._restart_at = self.clock() + delay
        self._set_state(RESTARTING)
        self.logger.warning(
            "Saguaro: drafter (pid %s) %s; restarting it%s (restart %d of %d); steps go on without drafts",
            pid, reason, f" in {delay:.0f} s" if delay else "", self.policy.count, self.policy.max_restarts)

    def _disable(self, reason: str) -> None:
        self.logger.error("Saguaro: %s; continuing WITHOUT speculation (outputs are unaffected).", reason)
        self.disabled_reason = reason
        self._retire()
        self._set_state(DISABLED)

    def _on_ready(self, msg: Ready) -> None:
        first = self.state == STARTING
        self.info = msg.info
        self.policy.on_ready()
        self.deadline.new_drafter()
        self._set_state(READY)
        if first:
            self.logger.info("Saguaro drafter ready (pid %d): %s", msg.pid, msg.info)
        else:
            self.logger.info("Saguaro: drafter back (pid %d, %.1f s after it failed); request contexts are "
                             "resent", msg.pid, self.clock() - self._failed_at)

    def _reply_problem(self, reason: str, detail: str) -> None:
        if self._invalid is None:
            self.logger.warning("Saguaro: drafter reply unusable (%s: %s): no drafts this step; further ones are "
                                "only counted (vllm:saguaro_drafter_failures_total)", reason, detail[:500])
        self._invalid = reason

    def _reply_fine(self) -> None:
        if self._invalid is not None:
            self.logger.info("Saguaro: drafter replies are valid again (last problem: %s)", self._invalid)
            self._invalid = None

    def _unavailable(self, reason: str, detail: str = "", delivered: bool = False) -> DrafterUnavailable:
        self.metrics.on_failure(reason)
        return DrafterUnavailable(reason, detail, delivered)

    # ---- polling (never blocks) ---------------------------------------------------------------------------------
    def poll(self) -> bool:
        """Advance the state machine without waiting; True if a step can be sent now."""
        if self.state == DISABLED:
            return False
        self._reap()
        if self.state == LATE:
            self._poll_late()
        elif self.state == READY:
            if (gone := self._gone()) is not None:
                self._lost(gone)
            elif self.policy.refill():
                self.logger.info("Saguaro: drafter healthy for %.0f s; restart budget refilled",
                                 self.policy.healthy_reset_s)
        elif self.chan is None:  # restarting: waiting for the old process to go and for the backoff
            if not self._dying and self.clock() >= self._restart_at:
                self._start()
        else:
            self._poll_loading()
        return self.state == READY

    def _poll_loading(self) -> None:
        try:
            msg = self.chan.recv(timeout_s=0, max_bytes=CONTROL_MAX_BYTES)
        except MessageRejected as err:
            self._lost(f"sent a malformed start-up message ({err})")
            return
        if isinstance(msg, Ready):
            self._on_ready(msg)
        elif isinstance(msg, Failed):
            self._disable(f"drafter failed to start: {msg.error}")
        elif msg is not None:
            self._lost(f"sent {type(msg).__name__} before Ready")
        elif (gone := self._gone()) is not None:
            self._lost(f"{gone} while loading")
        elif self.clock() - self._started_at > self.startup_timeout_s:
            self._lost(f"did not load within {self.startup_timeout_s:.0f} s (saguaro.startup_timeout_s)")

    def _poll_late(self) -> None:
        late = self._late
        try:
            msg = self.chan.recv(timeout_s=0, max_bytes=late["max_bytes"], max_frames=late["max_frames"])
        except MessageRejected as err:
            msg = None
            self.metrics.on_failure(err.reason)
            self._reply_problem(err.reason, str(err))
            self._answered_late(None)
            return
        if isinstance(msg, StepResponse) and msg.step == late["step"]:
            self._answered_late(msg)
            return
        now = self.clock()
        if (gone := self._gone()) is not None:
            self._lost(f"{gone} while computing a late step")
        elif now - late["sent"] > self.step_timeout_s:
            self._lost(f"did not answer step {late['step']} within {self.step_timeout_s:g} s "
                       "(saguaro.step_timeout_s)")
        elif now - late["probed"] >= 1.0 and not self._busy(late):
            self._lost(f"stopped working on step {late['step']} (no CPU progress, no runnable thread): it is hung")

    def _answered_late(self, msg: StepResponse | None) -> None:
        late, self._late = self._late, None
        if msg is not None:  # (not measured: one outlier must not stretch every later step's wait)
            self._late_resync.extend(msg.resync)
        self._set_state(READY)
        self.logger.info("Saguaro: drafter answered its late step %d after %.1f s; drafts resume",
                         late["step"], self.clock() - late["sent"])

    def _busy(self, late: dict) -> bool:
        """Is the drafter still working on the late step (`drafter_policy.is_working`: computing, or runnable
        and waiting for a CPU), not stopped or deadlocked?"""
        probe = self._probe()
        now = self.clock()
        busy = is_working(late["cpu"], probe, now - late["probed"], BUSY_CPU_FRACTION)
        if probe is not None:
            late["cpu"] = probe.cpu_s
        late["probed"] = now
        return busy

    def take_late_resync(self) -> list[str]:
        """Requests a late answer asked to resend (the proposer applies them before its next step)."""
        out, self._late_resync = self._late_resync, []
        return out

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the drafter can take steps (True), or it is disabled or `timeout_s` (default
        `startup_timeout_s`) passed (False; start-up or restarts go on in the background)."""
        deadline = self.clock() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        while not self.poll():
            if self.state == DISABLED or self.clock() >= deadline:
                return False
            if self.chan is not None and self.state in (STARTING, RESTARTING):
                self.chan.sock.poll(50)
            else:
                time.sleep(0.05)
        return True

    def close(self) -> None:
        """Stop the drafter (blocking: at shutdown only)."""
        if self.chan is not None and self.state in (READY, LATE):
            self.chan.send(Shutdown())
        if self.chan is not None:
            self.chan.close()
        self.proc = self.chan = None
        self._finalizer()
        self._dying.clear()
        if self.state != DISABLED:
            self.disabled_reason = "closed"
            self._set_state(DISABLED)

    # ---- steps ------------------------------------------------------------------------------------------------
    def step(self, req: StepRequest) -> StepResponse:
        """Send one step and wait (boundedly) for its answer; raises DrafterUnavailable, never anything else."""
        try:
            return self._step(req)
        except DrafterUnavailable:
            raise
        except Exception as err:  # a bug here must cost drafts, not the request
            self.logger.exception("Saguaro: drafter client error")
            self._lost(f"left the client in an unknown state ({type(err).__name__}: {err})")
            raise self._unavailable("client_error", str(err), delivered=True) from None

    def _step(self, req: StepRequest) -> StepResponse:
        if not self.poll():
            raise self._unavailable(self.state)
        if not self.chan.send(req):  # no peer on the socket: a PAIR socket does not reconnect, restart
            self._lost(self._gone() or "dropped its connection")
            raise self._unavailable("send", "the drafter did not take the request")
        sent = self.clock()
        tokens = sum(len(r.new_tokens) for r in req.rows)
        limit = self.deadline.for_step(tokens)
        max_bytes, max_frames = reply_size_limit(req, self.vocab_size)
        probe = self._probe()
        while True:
            left = sent + limit - self.clock()
            try:
                msg = self.chan.recv(timeout_s=max(0.0, min(left, RECV_SLICE_S)), max_bytes=max_bytes,
                                     max_frames=max_frames)
            except MessageRejected as err:
                self._reply_problem(err.reason, str(err))
                raise self._unavailable(err.reason, str(err), delivered=True) from None
            if msg is None:
                if (gone := self._gone()) is not None:
                    self._lost(f"{gone} during a step")
                    raise self._unavailable("died", delivered=True)
                if left <= 0:
                    self._missed_deadline(req, sent, limit, tokens, max_bytes, max_frames, probe)
                    raise self._unavailable("timeout", f"no answer within {limit:.2f} s", delivered=True)
                continue
            if isinstance(msg, StepResponse) and msg.step < req.step:
                continue  # an answer to an earlier step: drop it
            if isinstance(msg, StepResponse) and msg.step == req.step and msg.error and not msg.drafts and req.rows:
                # the drafter could not decode the request: it holds nothing of it, so it is not delivered
                self._reply_problem("rejected", msg.error)
                raise self._unavailable("rejected", msg.error, delivered=False)
            problem = check_response(req, msg, self.vocab_size) if isinstance(msg, StepResponse) else \
                f"unexpected: a {type(msg).__name__} message during a step"
            if problem is not None:
                reason = problem.split(":", 1)[0]
                self._reply_problem(reason, problem)
                raise self._unavailable(reason, problem, delivered=True)
            self.deadline.observe(self.clock() - sent, tokens)
            if msg.error:  # the drafter's step raised; it freed the rows and asks for them again
                self.metrics.on_failure("drafter_error")
                self._reply_problem("drafter_error", msg.error)
            else:
                self._reply_fine()
            return msg

    def _missed_deadline(self, req, sent, limit, tokens, max_bytes, max_frames, probe) -> None:
        late = {"step": req.step, "sent": sent, "tokens": tokens, "max_bytes": max_bytes, "max_frames": max_frames,
                "cpu": probe.cpu_s if probe else 0.0, "probed": sent}
        if self.step_timeout_s > limit and self._busy(late):
            self._late = late
            self._set_state(LATE)
            self.logger.warning(
                "Saguaro: drafter did not answer step %d within %.2f s (derived from measured step times) but "
                "is computing; steps go on without drafts until it answers (at most saguaro.step_timeout_s = "
                "%g s)", req.step, limit, self.step_timeout_s)
        else:
            self._lost(f"did not answer step {req.step} within {limit:.2f} s and is not computing (no CPU progress, no runnable thread): it is hung")
