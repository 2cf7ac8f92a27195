"""Drafter faults injected into a running `vllm serve` (not a test module: serve_cases.py runs them on its
servers, test_faults.py checks the results).

Faults: SIGKILL, SIGSTOP (a hang, never continued) and a drafter that raises inside its steps (for 0.5 s),
each injected while 8 greedy streams are in flight. For each: every request completes with the target's
own greedy output (the plain server's), the fault costs at most one bounded wait (the batch takes at most SLACK_S
longer than a healthy one and no stream waits more than its fault's MAX_GAP_S between two chunks),
`/metrics` counts the failed steps and the restart, and speculation resumes once the new drafter is up
(drafts and vLLM's accepted-token counter grow again).
"""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil

from saguaro_vllm.tools.server_process import VLLMServer, drafter_state, metric_totals

PROMPTS = ["def add(a, b):", "The quick brown fox jumps", "import os\nimport sys\nprint(", "for i in range(10):",
           "class Point:\n    def __init__(self, x, y):", "print(os.getcwd()", "The lazy dog", "return a + b"]
MAX_TOKENS = 320  # long enough that no stream ends before the last one has its first chunks (async got faster)
#: Testing aid of the drafter (saguaro_vllm/drafter/server.py): every step raises while this file exists.
FAIL_ENV = "SAGUARO_DRAFTER_FAIL_FILE"
FAULT_AFTER_CHUNKS = 3  # inject once every stream has received this many chunks (all requests in flight;
#                        async streams 128 tokens in ~1 s, so a later trigger can find one finished)
# The bounds, measured over 10 repeats of each fault with benchmarks/fault_pauses.py (benchmarks/notes.md
# "A drafter fault's pause"): a death pauses no stream for more than 1 s, a hang for no more than one deadline
# (its floor, 1 s, where steps take milliseconds) + 0.5 s, and a faulty batch ends within 2 s
# of the healthy one. They hold for chunks timed by a reader that gets the CPU when they arrive
# (stream_reader.py at real-time priority); where the test may not raise its priority, the reader's own
# waits for a CPU on a 2-core machine are in its gaps, and UNPRIVILEGED_GAP_S applies instead.
MAX_GAP_S = {"sigkill": 1.0, "sigstop": 1.0 + 0.5, "raising": 1.0}
SLACK_S = 2.0  # a faulty batch may take this much longer than the healthy batch just before it
UNPRIVILEGED_GAP_S = 3.0
BATCH_TIMEOUT_S = 60.0
READER = Path(__file__).with_name("stream_reader.py")  # times each chunk in a process of its own
RECOVERY_S = 90.0  # the replacement drafter loads (a fresh Python + torch) in the background

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:saguaro_draft_tokens_total"  # counted in the worker: no lag behind the engine
RESTARTS = "vllm:saguaro_drafter_restarts_total"
FAILURES = "vllm:saguaro_drafter_failures_total"

#: (fault, mode, restarts it must cost); run in this order on each mode's server.
FAULTS = [("sigkill", "async", 1), ("sigstop", "async", 1), ("raising", "async", 0), ("sigstop", "sync", 1)]


def metrics(server: VLLMServer) -> dict[str, float]:
    """The server's /metrics, each sample name summed over its labels."""
    return metric_totals(server.metric_samples())


def _total(samples: dict[str, float], name: str) -> float:
    return samples.get(name, 0.0)


@dataclasses.dataclass
class Batch:
    texts: list[str]
    seconds: float
    max_gap_s: float
    errors: list[str]
    started: float = 0.0  # time.monotonic() at the start
    injected: float | None = None  # time.monotonic() when the fault was injected
    arrivals: list[list[float]] = dataclasses.field(default_factory=list)  # per stream, each chunk's time
    realtime: bool = False  # whether the reader ran at real-time priority

    def longest_gap(self) -> tuple[int, float, float]:
        """(stream, start, end) of the longest wait between two chunks of one stream."""
        return max(((i, a, b) for i, arr in enumerate(self.arrivals) for a, b in zip(arr, arr[1:])),
                   key=lambda g: g[2] - g[1], default=(0, self.started, self.started))


def drafters(server: VLLMServer) -> list[psutil.Process]:
    """The live drafter processes under the server (children of its worker)."""
    return [p for role, p in server.processes() if role == "drafter"]


def the_drafter(server: VLLMServer) -> psutil.Process:
    found = drafters(server)
    assert len(found) == 1, f"expected one drafter process, found {found}\n{saguaro_log(server)}"
    return found[0]


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def saguaro_log(server: VLLMServer, lines: int = 40) -> str:
    """The Saguaro lines of the server log, for assertion messages."""
    text = Path(server.log_path).read_text(errors="replace").splitlines()
    return "\n".join([ln for ln in text if "Saguaro" in ln or "saguaro-drafter" in ln][-lines:])


def run_batch(server: VLLMServer, inject=None) -> Batch:
    """8 concurrent greedy streams, read and timed by tests/stream_reader.py (a process of its own, at
    real-time priority where allowed); `inject()` runs once every stream has received FAULT_AFTER_CHUNKS
    chunks."""
    arrivals: list[list[float]] = [[] for _ in PROMPTS]
    pieces: list[list[str]] = [[] for _ in PROMPTS]
    errors: list[str] = []
    done: set[int] = set()
    realtime: list[bool] = []
    cmd = [sys.executable, str(READER), server.url, str(MAX_TOKENS), *(json.dumps(p) for p in PROMPTS)]
    start = time.monotonic()
    reader = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def collect() -> None:
        for line in reader.stdout:
            event = json.loads(line)
            if "t" in event:
                arrivals[event["i"]].append(event["t"])
                pieces[event["i"]].append(event["text"])
            elif "error" in event:
                errors.append(f"request {event['i']}: {event['error']}")
            elif event.get("done"):
                done.add(event["i"])
            elif "realtime" in event:
                realtime.append(event["realtime"])

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    injected = None
    deadline = start + BATCH_TIMEOUT_S
    if inject is not None:
        while min(len(a) for a in arrivals) < FAULT_AFTER_CHUNKS and time.monotonic() < deadline and not done:
            time.sleep(0.005)
        assert not done, (f"streams {sorted(done)} ended before the fault (chunks per stream: "
                          f"{[len(a) for a in arrivals]}; errors: {errors}): lengthen the requests if none failed")
        injected = time.monotonic()
        inject()
    try:
        reader.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.wait()
    collector.join(timeout=10)
    stuck = [i for i in range(len(PROMPTS)) if i not in done]
    if stuck:
        errors.append(f"requests {stuck} still streaming after {BATCH_TIMEOUT_S:.0f} s")
    # the batch ends at its last chunk (the reader process's own exit is not the server's time)
    seconds = max((a[-1] for a in arrivals if a), default=start) - start
    gaps = [b - a for arr in arrivals for a, b in zip(arr, arr[1:])]
    return Batch(["".join(p) for p in pieces], seconds, max(gaps, default=0.0), errors, start, injected, arrivals,
                 realtime=bool(realtime and realtime[0]))


def reference_batch(server: VLLMServer) -> list[str]:
    """The streamed texts of the batch from a server without speculation."""
    batch = run_batch(server)
    assert not batch.errors, batch.errors
    return batch.texts


def wait_drafting(server: VLLMServer, restarts_at_least: float = 0.0) -> dict[str, float]:
    """Send short greedy requests until the drafter proposes drafts again (and, after a restart, the
    restart is counted); return the metrics then."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=30, max_retries=0)
    deadline = time.monotonic() + RECOVERY_S
    while True:
        before = metrics(server)
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
        after = metrics(server)
        if _total(after, DRAFT_TOKENS) > _total(before, DRAFT_TOKENS) and _total(after, RESTARTS) >= restarts_at_least:
            return after
        assert time.monotonic() < deadline, (
            f"no drafts {RECOVERY_S:.0f} s after the fault (restarts counted: {_total(after, RESTARTS)})\n"
            f"{saguaro_log(server)}")
        time.sleep(0.5)


def check_fault(server: VLLMServer, reference: list[str], inject, *, restarts: int, max_gap_s: float) -> dict:
    """Healthy batch, faulty batch, recovery, resumed batch; the assertions every fault shares. Returns the
    figures (printed by the test)."""
    m0 = wait_drafting(server)
    healthy = run_batch(server)
    assert not healthy.errors and healthy.texts == reference, healthy.errors
    m1 = metrics(server)
    assert _total(m1, ACCEPTED) > _total(m0, ACCEPTED), "no speculation in the healthy batch"

    faulty = run_batch(server, inject)
    m2 = metrics(server)
    log = saguaro_log(server)
    assert not faulty.errors, f"{faulty.errors}\n{log}"
    assert faulty.texts == reference, "a faulty batch's output differs from the target's"
    assert _total(m2, FAILURES) > _total(m1, FAILURES), f"the fault did not reach a step\n{log}"
    gap, seconds, healthy_s = faulty.max_gap_s, faulty.seconds, healthy.seconds
    bound = max_gap_s if faulty.realtime else UNPRIVILEGED_GAP_S
    assert gap < bound, f"a stream waited {gap:.2f} s for a chunk (bound {bound} s)\n{log}"
    assert seconds < healthy_s + SLACK_S, f"faulty batch {seconds:.2f} s vs healthy {healthy_s:.2f} s\n{log}"

    m3 = wait_drafting(server, restarts_at_least=_total(m1, RESTARTS) + restarts)
    resumed = run_batch(server)
    m4 = metrics(server)
    assert not resumed.errors and resumed.texts == reference, resumed.errors
    assert _total(m4, DRAFT_TOKENS) > _total(m3, DRAFT_TOKENS), "no drafts after recovery"
    assert _total(m4, ACCEPTED) > _total(m3, ACCEPTED), "speculation did not resume"
    state = drafter_state(server.metric_samples())
    assert state == "ready", state
    assert _total(m4, RESTARTS) - _total(m1, RESTARTS) == restarts, saguaro_log(server)
    return {"healthy_s": healthy_s, "faulty_s": seconds, "longest_gap_s": gap, "gap_bound_s": bound,
            "failed_steps": _total(m2, FAILURES) - _total(m1, FAILURES),
            "restarts": _total(m4, RESTARTS) - _total(m1, RESTARTS), "resumed_s": resumed.seconds,
            "accepted_after": _total(m4, ACCEPTED) - _total(m3, ACCEPTED)}


def _signal_fault(server: VLLMServer, sig: int, victim: list[psutil.Process]):
    def inject():
        victim.append(the_drafter(server))
        victim[0].send_signal(sig)  # SIGSTOP is never continued: the client must notice, kill and replace it
    return inject


def _one_fault(server: VLLMServer, fault: str, reference: list[str], fail_file: Path, restarts: int) -> dict:
    if fault == "raising":
        def fail_for_a_while():  # every step raises inside the drafter for 0.5 s
            fail_file.touch()
            time.sleep(0.5)
            fail_file.unlink()

        figures = check_fault(server, reference, fail_for_a_while, restarts=restarts, max_gap_s=MAX_GAP_S[fault])
        assert FAIL_ENV in Path(server.log_path).read_text(errors="replace"), "the drafter logged no injected failure"
        return figures
    victim: list[psutil.Process] = []
    sig = signal.SIGKILL if fault == "sigkill" else signal.SIGSTOP
    figures = check_fault(server, reference, _signal_fault(server, sig, victim), restarts=restarts,
                          max_gap_s=MAX_GAP_S[fault])
    assert gone(victim[0]), f"the {fault} drafter (pid {victim[0].pid}) is still there"
    assert the_drafter(server).pid != victim[0].pid
    return figures


def run_faults(server: VLLMServer, mode: str, reference: list[str] | None, fail_file: Path) -> dict[str, dict]:
    """Every fault of FAULTS for `mode`, in order, on this server: {"<fault>-<mode>": {"figures": ...} or
    {"error": traceback}} (recorded, so that each fault fails only its own test)."""
    out: dict[str, dict] = {}
    for fault, fault_mode, restarts in FAULTS:
        if fault_mode != mode:
            continue
        try:
            assert reference is not None, "no reference batch (the plain server failed)"
            out[f"{fault}-{mode}"] = {"figures": _one_fault(server, fault, reference, fail_file, restarts)}
        except Exception:
            out[f"{fault}-{mode}"] = {"error": traceback.format_exc()}
            fail_file.unlink(missing_ok=True)
    return out
