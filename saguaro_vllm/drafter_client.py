"""The proposer's handle on the drafter process: start it, talk to it, restart it, stop it.

Every failure here (a drafter that cannot load, crashes, or answers too late) degrades to "no drafts this
step": vLLM then decodes without speculation and the user's request is unaffected. A dead drafter is
restarted a bounded number of times; after a restart all request contexts are resent from scratch.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
import weakref

from saguaro_vllm.transport import (
    Channel,
    Failed,
    Ready,
    Shutdown,
    StepRequest,
    StepResponse,
    endpoint_path,
    new_endpoint,
)

MAX_RESTARTS = 3


class DrafterUnavailable(RuntimeError):
    """The drafter cannot answer now; the caller proposes no drafts."""


def _stop(proc: subprocess.Popen | None, chan: Channel | None, endpoint: str | None) -> None:
    if chan is not None:
        try:
            chan.send(Shutdown())
        except Exception:
            pass
    if proc is not None and proc.poll() is None:
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
    if chan is not None:
        chan.close()
    if endpoint is not None:
        shutil.rmtree(os.path.dirname(endpoint_path(endpoint)), ignore_errors=True)


class DrafterClient:
    def __init__(self, cfg: dict, logger):
        self.cfg = cfg
        self.logger = logger
        self.proc: subprocess.Popen | None = None
        self.chan: Channel | None = None
        self.endpoint: str | None = None
        self.ready = False
        self.disabled_reason: str | None = None
        self.restarts = 0
        self.generation = 0  # bumped on every (re)start: request contexts must be resent
        self.info: dict = {}
        self._started_at = 0.0
        self._finalizer = None
        self.start()

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.endpoint = new_endpoint()
        self.chan = Channel(self.endpoint, bind=True)
        env = dict(os.environ)
        # The drafter must not inherit the target worker's OpenMP binding or thread count.
        for key in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "saguaro_vllm.drafter.server", "--endpoint", self.endpoint,
               "--config", json.dumps(self.cfg), "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=False)
        self.ready = False
        self.generation += 1
        self._started_at = time.monotonic()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.chan, self.endpoint)
        atexit.register(self._finalizer)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the drafter has loaded (True), or failed / timed out (False, drafting disabled)."""
        if self.ready or self.disabled_reason:
            return self.ready
        budget = self.cfg["saguaro"]["startup_timeout_s"] if timeout_s is None else timeout_s
        deadline = self._started_at + budget
        while True:
            left = deadline - time.monotonic()
            msg = self.chan.recv(timeout_s=max(0.0, min(left, 1.0)))
            if isinstance(msg, Ready):
                self.ready, self.info = True, msg.info
                self.logger.info("Saguaro drafter ready (pid %d): %s", msg.pid, msg.info)
                return True
            if isinstance(msg, Failed):
                return self._disable(f"drafter failed to start: {msg.error}")
            if self.proc.poll() is not None:
                return self._disable(f"drafter process exited with code {self.proc.returncode} during start")
            if left <= 0:
                return self._disable(f"drafter did not start within {budget:.0f} s (saguaro.startup_timeout_s)")

    def _disable(self, reason: str) -> bool:
        self.logger.error("Saguaro: %s; continuing WITHOUT speculation (outputs are unaffected).", reason)
        self.disabled_reason = reason
        self.close()
        return False

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.proc = self.chan = None
        self.ready = False

    # ---- steps -----------------------------------------------------------------------------------
    def step(self, req: StepRequest) -> StepResponse:
        """Send one step and wait for its answer; raises DrafterUnavailable (never anything else)."""
        if self.disabled_reason:
            raise DrafterUnavailable(self.disabled_reason)
        if not self.ready and not self.wait_ready():
            raise DrafterUnavailable(self.disabled_reason or "drafter not ready")
        if self.proc.poll() is not None:
            self._restart(f"drafter process died (exit code {self.proc.returncode})")
            raise DrafterUnavailable("drafter restarting")
        if not self.chan.send(req):
            if self.proc.poll() is not None:
                self._restart(f"drafter process died (exit code {self.proc.returncode})")
            raise DrafterUnavailable("drafter did not take the step request")
        deadline = time.monotonic() + self.cfg["saguaro"]["step_timeout_s"]
        while True:
            msg = self.chan.recv(timeout_s=max(0.0, min(deadline - time.monotonic(), 1.0)))
            if isinstance(msg, StepResponse):
                if msg.step == req.step:
                    if msg.error:
                        self.logger.warning("Saguaro drafter step failed: %s", msg.error)
                    return msg
                continue  # a late answer to an abandoned step: drop it
            if self.proc.poll() is not None:
                self._restart(f"drafter process died (exit code {self.proc.returncode})")
                raise DrafterUnavailable("drafter restarting")
            if time.monotonic() >= deadline:
                raise DrafterUnavailable(
                    f"drafter did not answer within {self.cfg['saguaro']['step_timeout_s']} s "
                    "(saguaro.step_timeout_s)"
                )

    def _restart(self, reason: str) -> None:
        self.close()
        if self.restarts >= MAX_RESTARTS:
            self._disable(f"{reason}; gave up after {MAX_RESTARTS} restarts")
            return
        self.restarts += 1
        self.logger.warning("Saguaro: %s; restarting it (%d/%d)", reason, self.restarts, MAX_RESTARTS)
        self.start()
