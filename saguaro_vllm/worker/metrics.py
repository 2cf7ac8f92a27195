"""Saguaro's own metrics, in vLLM's Prometheus naming style, plus a periodic log line.

The proposer lives in vLLM's worker process, so these reach the server's `/metrics` only when the server
runs in Prometheus multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before `vllm serve`); the log line
always works. Every sample carries vLLM's `engine` label (the data-parallel rank, "0" without data
parallelism), so that each DP rank's drafter is told apart, as vLLM's own per-engine metrics are. vLLM's own
spec-decode counters (drafts, draft tokens, accepted tokens) stay as they are.
"""
from __future__ import annotations

import time

from saguaro_vllm.worker.drafter_states import STATES
from saguaro_vllm.worker.speculation_watch import SpeculationWatch

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
                buckets=STEP_BUCKETS, labelnames=["engine"]),
            "compute": prometheus_client.Histogram(
                "vllm:saguaro_drafter_compute_seconds",
                "Drafter compute time for one step, measured inside the drafter process.",
                buckets=STEP_BUCKETS, labelnames=["engine"]),
            "draft_tokens": prometheus_client.Counter(
                "vllm:saguaro_draft_tokens", "Draft tokens returned by the Saguaro drafter.", labelnames=["engine"]),
            "requests": prometheus_client.Gauge(
                "vllm:saguaro_drafter_requests", "Requests whose state the drafter holds.",
                multiprocess_mode="livesum", labelnames=["engine"]),
            "free_blocks": prometheus_client.Gauge(
                "vllm:saguaro_drafter_free_kv_blocks", "Free blocks of the drafter's paged KV cache.",
                multiprocess_mode="livesum", labelnames=["engine"]),
            "lookups": prometheus_client.Counter(
                "vllm:saguaro_cache_lookups",
                "Speculation-cache lookups (mode async), by the accepted count of the outcome looked up "
                "(depth='none': not one outcome, e.g. a skipped step).", labelnames=["depth", "engine"]),
            "hits": prometheus_client.Counter(
                "vllm:saguaro_cache_hits",
                "Speculation-cache hits (mode async), by the accepted count of the outcome.",
                labelnames=["depth", "engine"]),
            "backups": prometheus_client.Counter(
                "vllm:saguaro_backups", "Cache misses answered by a backup (mode async), by kind (jit, ngram).",
                labelnames=["kind", "engine"]),
            "dropped": prometheus_client.Counter(
                "vllm:saguaro_branches_dropped",
                "Pre-draft candidates left out because the drafter's KV cache was full (mode async); "
                "raise saguaro.kv_cache_gb if this grows.", labelnames=["engine"]),
            "budget": prometheus_client.Gauge(
                "vllm:saguaro_fanout_budget",
                "Pre-drafted branches per request planned in the last round (mode async).",
                multiprocess_mode="livemax", labelnames=["engine"]),
            "depth": prometheus_client.Gauge(
                "vllm:saguaro_draft_depth",
                "Drafts per row the drafter allowed in the last step (mode async, depth auto).",
                multiprocess_mode="livemax", labelnames=["engine"]),
            "depth_steps": prometheus_client.Counter(
                "vllm:saguaro_depth_steps",
                "Steps answered at each allowed depth (mode async, depth auto).", labelnames=["depth", "engine"]),
            "predraft": prometheus_client.Histogram(
                "vllm:saguaro_predraft_seconds",
                "Drafter time spent pre-drafting one round (mode async); compare with verify_seconds.",
                buckets=STEP_BUCKETS, labelnames=["engine"]),
            "verify": prometheus_client.Histogram(
                "vllm:saguaro_verify_seconds",
                "Time between the drafter's answer and the proposer sending the next request: the target's "
                "verification (mode async).", buckets=STEP_BUCKETS, labelnames=["engine"]),
            "late": prometheus_client.Histogram(
                "vllm:saguaro_late_seconds",
                "Time a step request waited for the drafter to finish the pre-draft forward in flight "
                "(mode async).", buckets=STEP_BUCKETS, labelnames=["engine"]),
            "rounds": prometheus_client.Counter(
                "vllm:saguaro_rounds",
                "Steps answered after a round that pre-drafted (mode='predraft') or that left its rows to be "
                "drafted after the verification as mode sync does (mode='sync': the pre-draft could not pay; "
                "mode async).", labelnames=["mode", "engine"]),
            "skipped": prometheus_client.Counter(
                "vllm:saguaro_predraft_skipped",
                "Rounds whose branch steps the drafter skipped because their expected saving was below the "
                "lateness they cause (mode async; low hit rates at batch sizes > 1).", labelnames=["engine"]),
            "cut_short": prometheus_client.Counter(
                "vllm:saguaro_predraft_cut_short",
                "Pre-drafts still running when the next step's request came, cut short: the branches drafted "
                "so far are cached (mode async, finish_predraft false).", labelnames=["engine"]),
            "topups": prometheus_client.Counter(
                "vllm:saguaro_topups",
                "Cache hits on a branch that was cut short, completed to K drafts on the critical path (mode "
                "async).", labelnames=["engine"]),
            "sampled": prometheus_client.Counter(
                "vllm:saguaro_sampled_drafts",
                "Sampled draft tokens sent for verification (temperature > 0; mode async), by whether their "
                "round's Saguaro sampling C was below 1.", labelnames=["scaled", "engine"]),
            "scale_sum": prometheus_client.Counter(
                "vllm:saguaro_sampled_drafts_scale",
                "Sum of the Saguaro sampling C over the sampled draft tokens (mode async): divided by "
                "vllm:saguaro_sampled_drafts_total it is the mean C in use (sampling_scale \"auto\").",
                labelnames=["engine"]),
            "branch_blocks": prometheus_client.Counter(
                "vllm:saguaro_branch_blocks",
                "Drafter KV blocks taken by pre-drafted branches (mode async): partial blocks copied when a "
                "branch forks (kind fork_copy) and new blocks as it grows past a block edge (kind growth).",
                labelnames=["kind", "engine"]),
            "no_room": prometheus_client.Counter(
                "vllm:saguaro_rows_no_room",
                "Rows that got no drafts because the drafter's KV cache had no room for them (both modes; they "
                "complete unspeculated); raise saguaro.kv_cache_gb if this grows.", labelnames=["engine"]),
            "ring_bytes": prometheus_client.Gauge(
                "vllm:saguaro_proposal_ring_bytes",
                "Bytes reserved for the proposal ring (sampled rows' draft probabilities on /dev/shm): 2 slots x "
                "rows (saguaro.max_sampled_rows) x K x vocab x 4 B plus a header page; a sparse file, so memory "
                "is used only by the rows written.", multiprocess_mode="livesum", labelnames=["engine"]),
            "capped": prometheus_client.Counter(
                "vllm:saguaro_sampled_rows_capped",
                "Sampled rows that got no drafts because the step's drafted rows outnumbered the proposal ring's "
                "rows (saguaro.max_sampled_rows); they complete unspeculated, output unaffected.",
                labelnames=["engine"]),
            "failures": prometheus_client.Counter(
                "vllm:saguaro_drafter_failures",
                "Steps in which the drafter could not answer (no drafts proposed; outputs unaffected), by "
                "reason (docs/metrics.md).", labelnames=["reason", "engine"]),
            "restarts": prometheus_client.Counter(
                "vllm:saguaro_drafter_restarts",
                "Drafter restarts after a crash, a hang or a malformed start-up (docs/troubleshooting.md).",
                labelnames=["engine"]),
            "state": prometheus_client.Gauge(
                "vllm:saguaro_drafter_state",
                "1 for the drafter client's current state (starting, ready, late, restarting, disabled), "
                "0 for the others.", labelnames=["state", "engine"], multiprocess_mode="livesum"),
            "speculating": prometheus_client.Gauge(
                "vllm:saguaro_speculating",
                "1 while rows get drafts, 0 while speculation is stalled: over the last 64 steps fewer than 10 % "
                "of the rows asking for drafts got any (back to 1 at 30 %; docs/troubleshooting.md).",
                multiprocess_mode="livesum", labelnames=["engine"]),
            "undrafted": prometheus_client.Counter(
                "vllm:saguaro_rows_undrafted",
                "Rows that asked the drafter for drafts and got none, by the drafter's row status (why).",
                labelnames=["status", "engine"]),
        }
    return _PROM or {}


def saguaro_samples() -> dict[str, float]:
    """Every `vllm:saguaro_*` Prometheus sample of this process, labelled ones keyed `name{label="value"}`
    (what benchmarks and tests read from a one-process engine, where the proposer lives). Without the
    `engine` label (a one-process engine is one engine; samples of several are summed)."""
    out: dict[str, float] = {}
    if prometheus_client is None:
        return out
    for metric in prometheus_client.REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith("vllm:saguaro"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "engine")
                key = f"{sample.name}{{{labels}}}" if labels else sample.name
                out[key] = out.get(key, 0.0) + sample.value
    return out


class SaguaroMetrics:
    """Counts per process; `snapshot()` is what tests and the demo read."""

    def __init__(self, cfg: dict, logger):
        self.logger = logger
        self.interval = float(cfg.get("saguaro", {}).get("log_interval_s", 10.0))
        self.engine = str(cfg.get("engine", 0))  # vLLM's `engine` label: this engine's data-parallel rank
        self._export_zeros()
        self.steps = self.rows = self.draft_tokens = self.failures = self.live_requests = 0
        self.round_trip_s = self.compute_s = 0.0
        self.lookups = self.hits = 0
        self.lookups_by_depth: dict[str, int] = {}
        self.hits_by_depth: dict[str, int] = {}
        self.backups: dict[str, int] = {"jit": 0, "ngram": 0}
        self.rounds: dict[str, int] = {"predraft": 0, "sync": 0}  # steps after a round of each mode
        self.predraft_s = self.verify_s = self.late_s = 0.0
        self.predraft_rounds = self.predraft_done = self.dropped = self.skipped = 0
        self.budget = 0
        self.cut_short = self.topups = self.rows_no_room = 0
        self.sampled_drafts = self.scaled_drafts = self.fork_copies = self.branch_blocks = 0
        self.depth = 0
        self.scale_sum = 0.0
        self.failures_by_reason: dict[str, int] = {}
        self.restarts = 0
        self.proposal_ring_bytes = self.sampled_rows_capped = 0
        self.drafter_state = ""
        self._last_log = time.monotonic()
        self._window = [0, 0.0, 0.0, 0, 0, 0]  # steps, round trip, compute, draft tokens, lookups, hits
        self.watch = SpeculationWatch()
        self.rows_undrafted = 0

    def on_step(self, round_trip_s: float, compute_s: float, rows: int, draft_tokens: int,
                live_requests: int = 0, free_blocks: int = 0, row_status: list[str] | None = None,
                row_depth: list[int] | None = None, ssd: dict | None = None,
                drafted_rows: list[bool] | None = None) -> None:
        """One answered step; `drafted_rows`: per row of the step, whether it got drafts (feeds the
        `SpeculationWatch`: one log line when speculation stalls or resumes)."""
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
            self._c("round_trip").observe(round_trip_s)
            self._c("compute").observe(compute_s)
            self._c("draft_tokens").inc(draft_tokens)
            self._c("requests").set(live_requests)
            self._c("free_blocks").set(free_blocks)
        if row_status:
            no_room = row_status.count("noroom")
            self.rows_no_room += no_room
            if no_room and self.prom:
                self._c("no_room").inc(no_room)
            self._on_ssd(row_status, row_depth or [-1] * len(row_status), ssd or {})
        if drafted_rows is not None:
            self._watch(drafted_rows, row_status)
        self._maybe_log()

    def _export_zeros(self) -> None:
        """Create this engine's child of every collector labelled by engine alone, so that each is on
        `/metrics` (at 0) from the start, as a collector without labels is: dashboards and alerts that read
        a counter before its first event see 0, not no data."""
        for collector in _prometheus().values():
            if tuple(collector._labelnames) == ("engine",):
                collector.labels(engine=self.engine)

    def _c(self, name: str, **labels: str):
        """Collector `name`'s child for this engine (and `labels`)."""
        return self.prom[name].labels(**labels, engine=self.engine)

    def _watch(self, drafted_rows: list[bool], row_status: list[str] | None) -> None:
        status = row_status if row_status and len(row_status) == len(drafted_rows) else ["unknown"] * len(drafted_rows)
        undrafted = [s for s, got in zip(status, drafted_rows, strict=True) if not got]
        self.rows_undrafted += len(undrafted)
        if self.prom:
            for s in set(undrafted):
                self._c("undrafted", status=s).inc(undrafted.count(s))
        change = self.watch.observe(len(drafted_rows), len(drafted_rows) - len(undrafted), undrafted)
        if change == "stalled":
            self.logger.warning("Saguaro: speculation stalled: %s; requests are served without drafts (exact, "
                                "at plain decoding speed) until rows get drafts again", self.watch.describe())
        elif change == "resumed":
            self.logger.info("Saguaro: speculation resumed: %s", self.watch.describe())
        if self.prom and (change or self.steps == 1):
            self._c("speculating").set(0 if self.watch.stalled else 1)

    def _on_ssd(self, row_status: list[str], row_depth: list[int], ssd: dict) -> None:
        """Cache lookups and hits per depth, backups, and the pre-draft vs verification timings."""
        prom = self.prom or {}
        for status, depth in zip(row_status, row_depth):
            if status not in ("hit", "jit", "ngram"):
                continue  # new requests and rows without drafts have no round to look up
            label = str(depth) if depth >= 0 else "none"
            self.lookups += 1
            self._window[4] += 1
            self.lookups_by_depth[label] = self.lookups_by_depth.get(label, 0) + 1
            if prom:
                self._c("lookups", depth=label).inc()
            if status == "hit":
                self.hits += 1
                self._window[5] += 1
                self.hits_by_depth[label] = self.hits_by_depth.get(label, 0) + 1
                if prom:
                    self._c("hits", depth=label).inc()
            else:
                self.backups[status] += 1
                if prom:
                    self._c("backups", kind=status).inc()
        if ssd:
            mode = "predraft" if ssd.get("predrafted", True) else "sync"
            self.rounds[mode] += 1
            if prom:
                self._c("rounds", mode=mode).inc()
        if ssd.get("topups"):
            self.topups += int(ssd["topups"])
            if prom:
                self._c("topups").inc(int(ssd["topups"]))
        if ssd.get("sampled_drafts"):
            n, scaled = int(ssd["sampled_drafts"]), int(ssd.get("scaled_drafts", 0))
            self.sampled_drafts += n
            self.scaled_drafts += scaled
            self.scale_sum += float(ssd.get("scale_sum", 0.0))
            if prom:
                self._c("sampled", scaled="true").inc(scaled)
                self._c("sampled", scaled="false").inc(n - scaled)
                self._c("scale_sum").inc(float(ssd.get("scale_sum", 0.0)))
        for kind, key in (("fork_copy", "fork_copies"), ("growth", "branch_blocks")):
            if ssd.get(key):
                setattr(self, key, getattr(self, key) + int(ssd[key]))
                if prom:
                    self._c("branch_blocks", kind=kind).inc(int(ssd[key]))
        if ssd.get("depth"):
            self.depth = int(ssd["depth"])
            if prom:
                self._c("depth").set(self.depth)
                self._c("depth_steps", depth=str(self.depth)).inc()
        if ssd.get("cut_short"):
            self.cut_short += 1
            if prom:
                self._c("cut_short").inc()
        if ssd.get("budget"):
            self.budget = int(ssd["budget"])
            self.predraft_rounds += 1
            self.predraft_done += int(bool(ssd.get("predraft_done")))
            self.predraft_s += float(ssd.get("predraft_s", 0.0))
            self.verify_s += float(ssd.get("verify_s", 0.0))
            self.dropped += int(ssd.get("dropped", 0))
            self.late_s += float(ssd.get("late_s", 0.0))
            self.skipped += int(bool(ssd.get("skipped")))
            if prom:
                self._c("late").observe(float(ssd.get("late_s", 0.0)))
                if ssd.get("skipped"):
                    self._c("skipped").inc()
                self._c("budget").set(self.budget)
                self._c("dropped").inc(int(ssd.get("dropped", 0)))
                self._c("predraft").observe(float(ssd.get("predraft_s", 0.0)))
                self._c("verify").observe(float(ssd.get("verify_s", 0.0)))

    def on_failure(self, reason: str) -> None:
        """A step without drafts; `reason` is a short label. Not logged: the drafter client logs each
        change of state once."""
        self.failures += 1
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
        self.prom = _prometheus()
        if self.prom:
            self._c("failures", reason=reason).inc()

    def on_ring(self, nbytes: int) -> None:
        """The proposal ring's reserved bytes (0: no ring), set once when the proposer creates it."""
        self.proposal_ring_bytes = nbytes
        self.prom = _prometheus()
        if self.prom:
            self._c("ring_bytes").set(nbytes)

    def on_capped(self, rows: int) -> None:
        """Sampled rows left without drafts this step by the ring's rows (logged once by the proposer)."""
        self.sampled_rows_capped += rows
        self.prom = _prometheus()
        if self.prom:
            self._c("capped").inc(rows)

    def on_drafter_restart(self) -> None:
        self.restarts += 1
        self.prom = _prometheus()
        if self.prom:
            self._c("restarts").inc()

    def on_drafter_state(self, state: str) -> None:
        self.drafter_state = state
        self.prom = _prometheus()
        if self.prom:
            for name in STATES:
                self._c("state", state=name).set(1 if name == state else 0)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval <= 0 or now - self._last_log < self.interval:
            return
        steps, rt, comp, toks, lookups, hits = self._window
        ssd = ""
        if lookups:
            ssd = (f", cache hit rate: {hits / lookups:.2f} ({lookups} lookups), fan-out budget: {self.budget}, "
                   f"backups jit/ngram: {self.backups['jit']}/{self.backups['ngram']}")
        self.logger.info(
            "Saguaro metrics: drafter steps: %d, mean step time: %.2f ms (drafter compute %.2f ms), "
            "draft tokens per step: %.2f, requests held by the drafter: %d, drafter failures: %d%s",
            steps, 1e3 * rt / steps, 1e3 * comp / steps, toks / steps, self.live_requests, self.failures, ssd,
        )
        self._window = [0, 0.0, 0.0, 0, 0, 0]
        self._last_log = now

    def snapshot(self) -> dict:
        return {
            "steps": self.steps, "rows": self.rows, "draft_tokens": self.draft_tokens,
            "failures": self.failures, "round_trip_s": self.round_trip_s, "compute_s": self.compute_s,
            "lookups": self.lookups, "hits": self.hits, "hit_rate": self.hits / self.lookups if self.lookups else 0.0,
            "lookups_by_depth": dict(self.lookups_by_depth), "hits_by_depth": dict(self.hits_by_depth),
            "backups": dict(self.backups), "rounds": dict(self.rounds), "fanout_budget": self.budget,
            "predraft_s": self.predraft_s, "verify_s": self.verify_s, "predraft_rounds": self.predraft_rounds,
            "predraft_done": self.predraft_done, "branches_dropped": self.dropped,
            "late_s": self.late_s, "predraft_skipped": self.skipped,
            "predraft_cut_short": self.cut_short, "topups": self.topups, "rows_no_room": self.rows_no_room,
            "failures_by_reason": dict(self.failures_by_reason), "restarts": self.restarts,
            "drafter_state": self.drafter_state, "sampled_drafts": self.sampled_drafts,
            "scaled_drafts": self.scaled_drafts, "scale_sum": self.scale_sum, "fork_copies": self.fork_copies,
            "branch_blocks": self.branch_blocks, "depth": self.depth,
            "proposal_ring_bytes": self.proposal_ring_bytes, "sampled_rows_capped": self.sampled_rows_capped,
            "speculating": not self.watch.stalled, "rows_undrafted": self.rows_undrafted,
        }
