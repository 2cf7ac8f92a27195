"""Saguaro's own metrics, in vLLM's Prometheus naming style, plus a periodic log line.

The proposer lives in vLLM's worker process, so these reach the server's `/metrics` only when the server
runs in Prometheus multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before `vllm serve`); the log line
always works. vLLM's own spec-decode counters (drafts, draft tokens, accepted tokens) stay as they are.
"""
from __future__ import annotations

import time

try:
    import prometheus_client
except ImportError:  # pragma: no cover - prometheus_client ships with vLLM
    prometheus_client = None

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_PROM: dict | None = None


def _prometheus() -> dict:
    """The collectors, created once per process (registering twice raises) and registered again if vLLM's
    stat logger unregistered every `vllm:` collector (it does at start-up, which in a single-process engine
    comes after the worker built the proposer)."""
    global _PROM
    if _PROM is not None:
        registry = prometheus_client.REGISTRY
        for collector in _PROM.values():
            if collector not in registry._collector_to_names:
                registry.register(collector)
    if _PROM is None and prometheus_client is not None:
        _PROM = {
            "round_trip": prometheus_client.Histogram(
                "vllm:saguaro_drafter_step_seconds",
                "Time the proposer waited for the drafter in one step (critical path).",
                buckets=STEP_BUCKETS),
            "compute": prometheus_client.Histogram(
                "vllm:saguaro_drafter_compute_seconds",
                "Drafter compute time for one step, measured inside the drafter process.",
                buckets=STEP_BUCKETS),
            "draft_tokens": prometheus_client.Counter(
                "vllm:saguaro_draft_tokens", "Draft tokens returned by the Saguaro drafter."),
            "requests": prometheus_client.Gauge(
                "vllm:saguaro_drafter_requests", "Requests whose state the drafter holds.",
                multiprocess_mode="livesum"),
            "free_blocks": prometheus_client.Gauge(
                "vllm:saguaro_drafter_free_kv_blocks", "Free blocks of the drafter's paged KV cache.",
                multiprocess_mode="livesum"),
            "failures": prometheus_client.Counter(
                "vllm:saguaro_drafter_failures",
                "Steps in which the drafter could not answer (no drafts proposed; outputs unaffected)."),
        }
    return _PROM or {}


class SaguaroMetrics:
    """Counts per process; `snapshot()` is what tests and the demo read."""

    def __init__(self, cfg: dict, logger):
        self.logger = logger
        self.interval = float(cfg.get("saguaro", {}).get("log_interval_s", 10.0))
        self.steps = self.rows = self.draft_tokens = self.failures = self.live_requests = 0
        self.round_trip_s = self.compute_s = 0.0
        self._last_log = time.monotonic()
        self._window = [0, 0.0, 0.0, 0]  # steps, round trip, compute, draft tokens since last log

    def on_step(self, round_trip_s: float, compute_s: float, rows: int, draft_tokens: int,
                live_requests: int = 0, free_blocks: int = 0) -> None:
        self.steps += 1
        self.live_requests = live_requests
        self.rows += rows
        self.draft_tokens += draft_tokens
        self.round_trip_s += round_trip_s
        self.compute_s += compute_s
        w = self._window
        w[0] += 1
        w[1] += round_trip_s
        w[2] += compute_s
        w[3] += draft_tokens
        self.prom = _prometheus()
        if self.prom:
            self.prom["round_trip"].observe(round_trip_s)
            self.prom["compute"].observe(compute_s)
            self.prom["draft_tokens"].inc(draft_tokens)
            self.prom["requests"].set(live_requests)
            self.prom["free_blocks"].set(free_blocks)
        self._maybe_log()

    def on_failure(self, reason: str) -> None:
        self.failures += 1
        self.prom = _prometheus()
        if self.prom:
            self.prom["failures"].inc()
        self.logger.warning("Saguaro: no drafts this step: %s", reason)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last_log < self.interval:
            return
        steps, rt, comp, toks = self._window
        self.logger.info(
            "Saguaro metrics: drafter steps: %d, mean step time: %.2f ms (drafter compute %.2f ms), "
            "draft tokens per step: %.2f, requests held by the drafter: %d, drafter failures: %d",
            steps, 1e3 * rt / steps, 1e3 * comp / steps, toks / steps, self.live_requests, self.failures,
        )
        self._window = [0, 0.0, 0.0, 0]
        self._last_log = now

    def snapshot(self) -> dict:
        return {
            "steps": self.steps, "rows": self.rows, "draft_tokens": self.draft_tokens,
            "failures": self.failures, "round_trip_s": self.round_trip_s, "compute_s": self.compute_s,
        }
