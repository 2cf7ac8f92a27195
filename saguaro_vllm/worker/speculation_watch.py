"""Tells when speculation has stopped being useful: rows ask for drafts step after step and get none.

A drafter that answers every step, but with no drafts for nearly every row (a backup rule that keeps
refusing, no room in its KV cache, no free proposal slot), looks healthy to every other check: no
failures, no restarts, requests keep flowing, just at the speed of plain decoding. Measured at vocabulary
128256, batch 16, T=1 (`benchmarks/bench_transport.py`): a whole run of 96 steps without one draft. `SpeculationWatch` counts,
over the last `window` steps, the rows that asked for drafts and the rows that got some, and reports a
change of state once: `stalled` when fewer than `stall_share` of at least `min_rows` rows got drafts,
`resumed` when at least `resume_share` do again (the gap between the two keeps a borderline workload from
flapping). Pure bookkeeping: `metrics.py` turns a change into one log line and a gauge.
"""
from __future__ import annotations

import collections
from collections import Counter
from collections.abc import Sequence

#: Steps the watch looks back over.
WINDOW = 64
#: Rows that must have asked within the window before the watch judges at all.
MIN_ROWS = 64
#: Stalled below this share of rows with drafts; resumed at or above `RESUME_SHARE`.
STALL_SHARE = 0.1
RESUME_SHARE = 0.3


class SpeculationWatch:
    def __init__(self, window: int = WINDOW, min_rows: int = MIN_ROWS, stall_share: float = STALL_SHARE,
                 resume_share: float = RESUME_SHARE):
        if not 0.0 <= stall_share < resume_share <= 1.0 or window < 1 or min_rows < 1:
            raise ValueError(f"bad SpeculationWatch({window}, {min_rows}, {stall_share}, {resume_share})")
        self.window, self.min_rows = window, min_rows
        self.stall_share, self.resume_share = stall_share, resume_share
        self._steps: collections.deque[tuple[int, int, Counter]] = collections.deque(maxlen=window)
        self.asked = self.drafted = 0  # over the window
        self.stalled = False

    def observe(self, asked: int, drafted: int, undrafted_status: Sequence[str] = ()) -> str | None:
        """One step: `asked` rows wanted drafts, `drafted` of them got some; `undrafted_status`: the drafter's
        row status of the others (why). Returns "stalled" or "resumed" on a change of state, else None."""
        if not 0 <= drafted <= asked:
            raise ValueError(f"drafted must lie in 0..asked, got {drafted} of {asked}")
        if len(self._steps) == self.window:
            old_asked, old_drafted, _ = self._steps[0]
            self.asked -= old_asked
            self.drafted -= old_drafted
        self._steps.append((asked, drafted, Counter(undrafted_status)))
        self.asked += asked
        self.drafted += drafted
        if self.asked < self.min_rows:
            return None
        share = self.drafted / self.asked
        if not self.stalled and share < self.stall_share:
            self.stalled = True
            return "stalled"
        if self.stalled and share >= self.resume_share:
            self.stalled = False
            return "resumed"
        return None

    def reasons(self) -> Counter:
        """Row status of the undrafted rows over the window (e.g. `ngram`: left to an n-gram backup that
        found nothing; `none`; `noroom`)."""
        total: Counter = Counter()
        for _, _, status in self._steps:
            total.update(status)
        return total

    def describe(self) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in self.reasons().most_common()) or "no status"
        return (f"{self.drafted} of {self.asked} rows got drafts over the last {len(self._steps)} steps "
                f"(row status of the others: {reasons})")
