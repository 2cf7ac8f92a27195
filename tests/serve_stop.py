"""Stopping a Saguaro `vllm serve` as its user would (not a test module: serve_cases.py stops its sync and
async servers this way, test_faults.py checks what it recorded).

`kill PID` (SIGTERM to the server process alone) and Ctrl-C (SIGINT to the whole process group, the drafter
included). Recorded per stop: whether the server exited, its log from the signal on (asserted free of
tracebacks from this package's code), and the drafter processes alive before the signal that are still there a few seconds after the
server's exit. The drafters are watched before `VLLMServer.stop` runs, since it SIGKILLs the group's stragglers.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import traceback
from pathlib import Path

from saguaro_vllm.tools.server_process import VLLMServer
from serve_faults import drafters, gone

EXIT_WAIT_S = 30.0  # as VLLMServer.stop waits for a SIGINT
#: A drafter goes with its parent: at once on the parent-death signal, else within its idle poll (1 s).
DRAFTER_WAIT_S = 5.0
#: How serve_cases.py stops each Saguaro server: (signal, sent to the whole process group).
STOPS = {"sync": (signal.SIGTERM, False), "async": (signal.SIGINT, True)}
#: Lines of a traceback that is ours: a frame in this package (every uncaught exception of the drafter has
#: one, its process's code starts in saguaro_vllm/drafter/server.py), or a KeyboardInterrupt from any process.
#: vLLM's own shutdown can log a traceback of its own that this leaves out (its API server's "AsyncLLM
#: output_handler failed ... EngineDeadError" when it force-kills its engine core, seen with Ctrl-C).
OURS = re.compile(r'File "[^"]*saguaro_vllm/|KeyboardInterrupt')


def our_traceback_lines(log: str) -> list[str]:
    """The lines of `log` that OURS matches."""
    return [line for line in log.splitlines() if OURS.search(line)]


def stop(server: VLLMServer, mode: str) -> dict:
    """Stop `server` as STOPS says for `mode`; then `server.stop()` (kills what is left). Returns the record
    test_faults.py checks, or {"error": traceback} (so that a failing stop fails only its own test)."""
    sig, group = STOPS[mode]
    try:
        watched = drafters(server)
        log = Path(server.log_path)
        start = log.stat().st_size
        t0 = time.monotonic()
        (os.killpg if group else os.kill)(server.proc.pid, sig)
        try:
            code = server.proc.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + DRAFTER_WAIT_S
        while not all(gone(p) for p in watched) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p.pid for p in watched if not gone(p)]
        seconds = time.monotonic() - t0  # the signal to the server's exit and its drafters' end
        server.stop()
        with open(log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        return {"signal": signal.Signals(sig).name, "group": group, "exit_code": code,
                "drafters": [p.pid for p in watched], "survivors": survivors, "seconds": round(seconds, 2),
                "log": text}
    except Exception:
        return {"error": traceback.format_exc()}
