"""What the drafter says when its KV cache is too small: rate-limited, never once per step.

A full cache is a steady state under load (every row that does not fit goes unspeculated until room frees),
so it gets one warning at the first occurrence and then at most one summary per `interval_s`; a context
longer than the whole cache can never be drafted for, which is said once per drafter process.
"""
from __future__ import annotations

import logging
import time

#: Seconds between two "KV cache full" warnings (each sums up the rows refused since the previous one).
NO_ROOM_LOG_INTERVAL_S = 60.0


class NoRoomLog:
    def __init__(self, logger: logging.Logger, interval_s: float = NO_ROOM_LOG_INTERVAL_S):
        self.logger = logger
        self.interval_s = interval_s
        self.warnings = 0  # "KV cache full" warnings logged
        self.oversize_warned = False
        self._pending = 0  # rows refused since the last warning
        self._last: float | None = None

    def note(self, rows: int, free_blocks: int, total_blocks: int) -> None:
        """`rows` rows of this step got no drafts for lack of room."""
        self._pending += rows
        if not self._pending:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval_s:
            return
        since = f"in the last {now - self._last:.0f} s" if self._last is not None else "in this step"
        self.logger.warning(
            "draft KV cache full: %d row(s) got no drafts %s (%d of %d blocks free); those requests continue "
            "unspeculated until room frees up. Raise saguaro.kv_cache_gb to speculate all of them "
            "(next summary in %.0f s at the earliest).", self._pending, since, free_blocks, total_blocks,
            self.interval_s)
        self.warnings += 1
        self._pending = 0
        self._last = now

    def oversize(self, req_id: str, context_tokens: int, capacity_tokens: int) -> None:
        """A context longer than the whole cache: that request goes unspeculated (said once per process)."""
        if self.oversize_warned:
            return
        self.oversize_warned = True
        self.logger.warning(
            "request %s: its context (%d tokens) is longer than the drafter's whole KV cache (%d tokens), so "
            "it goes unspeculated (its output is unaffected); so will any later context that long. Raise "
            "saguaro.kv_cache_gb to speculate such contexts. (Said once.)", req_id, context_tokens,
            capacity_tokens)
