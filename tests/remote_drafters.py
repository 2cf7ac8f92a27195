"""Start and stop `saguaro-vllm drafter --listen tcp://...` processes for tests (a helper, not a test).

Used from the test process and, between two jobs of one engine (`engine_runs.Job.before`), from the engine's
process as a command:

    python tests/remote_drafters.py start PIDFILE LOG PORT SECRET_FILE DRAFT   # returns once it listens
    python tests/remote_drafters.py kill PIDFILE                               # SIGKILL, waits for the exit
    python tests/remote_drafters.py sleep SECONDS
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

#: The drafter's host options on a 2-core test machine: the drafter on core 1, the target on core 0.
HOST_OPTIONS = {"device": "cpu", "draft_cores": [1], "dtype": "float32", "kv_cache_gb": 0.05,
                "max_tokens_per_forward": 256}


def start(pidfile: str, log: str, port: int, secret_file: str, draft: str, timeout_s: float = 180.0) -> int:
    """A drafter in its own session (it outlives the command that started it), once it listens."""
    cmd = [sys.executable, "-m", "saguaro_vllm.tools.cli", "drafter",
           "--listen", f"tcp://127.0.0.1:{port}", "--model", draft, "--secret-file", secret_file,
           "--saguaro", json.dumps(HOST_OPTIONS)]
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=_every_core)
    Path(pidfile).write_text(str(proc.pid))
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the drafter exited with {proc.returncode}:\n{Path(log).read_text()[-3000:]}")
        if f"listening on tcp://127.0.0.1:{port}" in Path(log).read_text():
            return proc.pid
        time.sleep(0.2)
    raise TimeoutError(f"the drafter did not listen within {timeout_s} s:\n{Path(log).read_text()[-3000:]}")


def _every_core() -> None:
    """Started from the engine's process, the drafter would inherit the target's cores: as on its own host,
    it may use every core (it pins itself to HOST_OPTIONS' draft_cores)."""
    os.sched_setaffinity(0, range(os.cpu_count()))


def kill(pidfile: str) -> None:
    """SIGKILL the drafter named in `pidfile` (if it still runs) and wait until it is gone."""
    try:
        pid = int(Path(pidfile).read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:  # our child when started from this process: reap it; otherwise wait for it to vanish
        os.waitpid(pid, 0)
    except ChildProcessError:
        while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
            time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "start":
        start(args[0], args[1], int(args[2]), args[3], args[4])
    elif what == "kill":
        kill(args[0])
    elif what == "sleep":
        time.sleep(float(args[0]))
    else:
        sys.exit(f"unknown command {what!r}")
