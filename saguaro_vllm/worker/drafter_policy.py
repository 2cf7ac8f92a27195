"""The pure rules of the drafter client: how long a step may wait, when to restart, which rows to hold back.

No processes and no sockets here (the client in `drafter_client.py` applies these), so each rule is tested
with an injected clock:

- `StepDeadline`: the wait for one answer, `multiple` x the recent p99 of answered steps (or of the
  per-token cost for a step carrying many tokens), at least `floor_s`, at most `cap_s` (`step_timeout_s`);
  `warmup_s` (capped the same way) until enough steps were measured and for the first steps of each drafter
  (which are not measured: lazy initialisation makes them slow).
- `RestartPolicy`: the first restart at once, then 1 s, 2 s, 4 s ... (at most 60 s) apart; `max_restarts`
  restarts, a budget that refills after `healthy_reset_s` of healthy service.
- `ResyncBackoff`: a request resynced `strikes` times within `window_steps` steps is not sent for 8, 16,
  32 ... steps (the proposer counts its `propose` calls), so one pathological request cannot cost a full
  resend every step.
- `process_progress` / `is_working`: the kernel's view of a process (run state, CPU seconds, runnable
  threads), to tell a hung drafter from a busy or CPU-starved one.
"""
from __future__ import annotations

import collections
import os
import time
from typing import Callable, NamedTuple


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class StepDeadline:
    #: steps with at least this many new tokens feed (and use) the per-token estimate
    BIG_STEP_TOKENS = 64

    def __init__(self, floor_s: float = 1.0, cap_s: float = 30.0, multiple: float = 8.0, warmup_s: float = 10.0,
                 min_samples: int = 8, warmup_steps: int = 2, window: int = 256):
        self.floor_s, self.cap_s, self.multiple, self.warmup_s = floor_s, cap_s, multiple, warmup_s
        self.min_samples, self.warmup_steps = min_samples, warmup_steps
        self._steps: collections.deque[float] = collections.deque(maxlen=window)
        self._per_token: collections.deque[float] = collections.deque(maxlen=window)
        self._generation_steps = 0

    def new_drafter(self) -> None:
        """A (re)started drafter: its first steps may be slow (lazy initialisation, caches)."""
        self._generation_steps = 0

    def observe(self, seconds: float, tokens: int) -> None:
        self._generation_steps += 1
        if self._generation_steps <= self.warmup_steps:
            return  # a new drafter's first steps say nothing about its steady state
        self._steps.append(seconds)
        if tokens >= self.BIG_STEP_TOKENS:
            self._per_token.append(seconds / tokens)

    def for_step(self, tokens: int) -> float:
        """Seconds the proposer may wait for the answer to a step that sends `tokens` new tokens."""
        warm = min(self.cap_s, max(self.floor_s, self.warmup_s))
        if len(self._steps) < self.min_samples or self._generation_steps <= self.warmup_steps:
            return warm
        expected = _quantile(list(self._steps), 0.99)
        if tokens >= self.BIG_STEP_TOKENS:
            if not self._per_token:
                return warm
            expected = max(expected, tokens * _quantile(list(self._per_token), 0.9))
        return min(self.cap_s, max(self.floor_s, self.multiple * expected))


class RestartPolicy:
    def __init__(self, max_restarts: int = 5, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 healthy_reset_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.max_restarts, self.backoff_s, self.max_backoff_s = max_restarts, backoff_s, max_backoff_s
        self.healthy_reset_s = healthy_reset_s
        self.clock = clock
        self.count = 0  # restarts since the budget last refilled
        self._ready_at: float | None = None

    def next_delay(self) -> float | None:
        """The drafter failed: seconds to wait before restarting it, or None when the budget is spent."""
        self._ready_at = None
        if self.count >= self.max_restarts:
            return None
        delay = 0.0 if self.count == 0 else min(self.max_backoff_s, self.backoff_s * 2 ** (self.count - 1))
        self.count += 1
        return delay

    def on_ready(self) -> None:
        self._ready_at = self.clock()

    def refill(self) -> bool:
        """Called while the drafter serves: True when this healthy period just refilled the budget."""
        if self.count and self._ready_at is not None and self.clock() - self._ready_at >= self.healthy_reset_s:
            self.count = 0
            return True
        return False


class ResyncBackoff:
    def __init__(self, strikes: int = 3, window_steps: int = 64, base_skip: int = 8, max_skip: int = 4096):
        self.strikes, self.window_steps = strikes, window_steps
        self.base_skip, self.max_skip = base_skip, max_skip
        self._recent: dict[str, list[int]] = {}
        self._level: dict[str, int] = {}
        self._until: dict[str, int] = {}

    def on_resync(self, req_id: str, step: int) -> None:
        recent = [s for s in self._recent.get(req_id, []) if step - s < self.window_steps] + [step]
        if len(recent) < self.strikes:
            self._recent[req_id] = recent
            return
        if recent[0] - self._until.get(req_id, -10**9) >= self.window_steps:
            self._level.pop(req_id, None)  # healthy for a window since the last backoff: start over
        level = self._level[req_id] = self._level.get(req_id, 0) + 1
        self._until[req_id] = step + 1 + min(self.max_skip, self.base_skip * 2 ** (level - 1))
        self._recent[req_id] = []

    def skip(self, req_id: str, step: int) -> bool:
        """Hold this request back in `step` (it gets no drafts and is resent from 0 afterwards)."""
        return step < self._until.get(req_id, -1)

    def forget(self, req_id: str) -> None:
        for d in (self._recent, self._level, self._until):
            d.pop(req_id, None)

    def clear(self) -> None:
        for d in (self._recent, self._level, self._until):
            d.clear()


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Progress(NamedTuple):
    """The kernel's view of a process: its main thread's run state letter, CPU seconds used by all its
    threads, and whether any of its threads is runnable (state `R`: running or waiting for a CPU)."""
    state: str
    cpu_s: float
    runnable: bool


def process_progress(pid: int) -> Progress | None:
    """`Progress` of `pid` from /proc (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = _stat_fields(stat)
    runnable = fields[0] == "R"
    if not runnable:  # a computing process may wait in its main thread on worker threads (OpenMP, torch)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    if _stat_fields(f.read())[0] == "R":
                        runnable = True
                        break
            except OSError:  # the thread ended meanwhile
                continue
    return Progress(fields[0], (int(fields[11]) + int(fields[12])) / _TICKS, runnable)


def _stat_fields(stat: str) -> list[str]:
    return stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses


def is_working(before_cpu_s: float, now: Progress | None, seconds: float, min_cpu_fraction: float) -> bool:
    """Is a drafter that has not answered still working on the request, from two looks `seconds` apart?

    Stopped (`T`, `t`), dead (`Z`, `X`) or gone: no. Used at least `min_cpu_fraction` of a CPU since the
    last look: yes. Used less but has a runnable thread: yes, it is waiting for a CPU on an oversubscribed
    machine (a starved drafter is slow, not hung; `step_timeout_s` still bounds it). Otherwise (every thread
    asleep, no progress: deadlocked, or blocked on something that will not come): no."""
    if now is None or now.state in "TtZX":
        return False
    return now.cpu_s - before_cpu_s >= min_cpu_fraction * seconds or now.runnable
