"""Writes docs/grafana/saguaro-dashboard.json: a Grafana dashboard with a panel for every `vllm:saguaro_*`
metric, beside vLLM's own speculative-decoding panels (acceptance, drafted and accepted tokens).

    .venv/bin/python scripts/make_dashboard.py      # after adding a metric to saguaro_vllm/worker/metrics.py

tests/test_dashboard.py checks that the file is what this script writes, that every collector of
metrics.py has a panel, and that every query names a metric the plugin exports (the serve test scrapes a
running server's /metrics for that).
"""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "saguaro-dashboard.json"
RATE = "[$__rate_interval]"
SEL = '{model_name=~"$model_name"}'

#: (title, unit, [(query, legend)], what it shows). `S` is the model selector vLLM's metrics carry.
ROWS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]], str]]]] = [
    ("vLLM speculative decoding", [
        ("Draft acceptance rate", "percentunit", [
            (f"rate(vllm:spec_decode_num_accepted_tokens_total{SEL}{RATE}) / "
             f"rate(vllm:spec_decode_num_draft_tokens_total{SEL}{RATE})", "accepted / drafted")],
         "vLLM's own counters: share of draft tokens the target accepted."),
        ("Mean acceptance length", "none", [
            (f"1 + rate(vllm:spec_decode_num_accepted_tokens_total{SEL}{RATE}) / "
             f"rate(vllm:spec_decode_num_drafts_total{SEL}{RATE})", "tokens per verification")],
         "Tokens committed per verification of a row with drafts."),
        ("Draft and accepted tokens / s", "short", [
            (f"rate(vllm:spec_decode_num_draft_tokens_total{SEL}{RATE})", "drafted"),
            (f"rate(vllm:spec_decode_num_accepted_tokens_total{SEL}{RATE})", "accepted")], ""),
    ]),
    ("Saguaro drafter", [
        ("Drafter state", "none", [("vllm:saguaro_drafter_state", "{{state}}")],
         "1 for the client's current state: starting, ready, late, restarting, disabled."),
        ("Speculating", "none", [("vllm:saguaro_speculating", "speculating")],
         "0 while rows ask for drafts and (nearly) none get any."),
        ("Rows left without drafts / s", "short", [
            (f"sum by (status) (rate(vllm:saguaro_rows_undrafted_total{RATE}))", "{{status}}")], ""),
        ("Drafter step time (p50, p99)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:saguaro_drafter_step_seconds_bucket{RATE})))", "p50 wait"),
            (f"histogram_quantile(0.99, sum by (le) (rate(vllm:saguaro_drafter_step_seconds_bucket{RATE})))", "p99 wait"),
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:saguaro_drafter_compute_seconds_bucket{RATE})))",
             "p50 compute")],
         "What the proposer waited for the drafter (critical path) and the drafter's own compute."),
        ("Draft tokens / s", "short", [(f"rate(vllm:saguaro_draft_tokens_total{RATE})", "draft tokens")], ""),
        ("Failures and restarts / s", "short", [
            (f"sum by (reason) (rate(vllm:saguaro_drafter_failures_total{RATE}))", "{{reason}}"),
            (f"rate(vllm:saguaro_drafter_restarts_total{RATE})", "restarts")], ""),
        ("Requests held, free KV blocks", "short", [
            ("vllm:saguaro_drafter_requests", "requests"), ("vllm:saguaro_drafter_free_kv_blocks", "free blocks")], ""),
        ("KV room", "short", [
            (f"rate(vllm:saguaro_rows_no_room_total{RATE})", "rows without room"),
            (f"rate(vllm:saguaro_branches_dropped_total{RATE})", "branches dropped")],
         "Grows: raise saguaro.kv_cache_gb."),
    ]),
    ("Saguaro SSD (mode async)", [
        ("Cache hit rate by depth", "percentunit", [
            (f"sum by (depth) (rate(vllm:saguaro_cache_hits_total{RATE})) / "
             f"sum by (depth) (rate(vllm:saguaro_cache_lookups_total{RATE}))", "depth {{depth}}"),
            (f"sum(rate(vllm:saguaro_cache_hits_total{RATE})) / sum(rate(vllm:saguaro_cache_lookups_total{RATE}))",
             "all")], "Lookups answered from the speculation cache, per accepted count."),
        ("Backups / s", "short", [(f"sum by (kind) (rate(vllm:saguaro_backups_total{RATE}))", "{{kind}}"),
                                  (f"rate(vllm:saguaro_topups_total{RATE})", "top-ups")], ""),
        ("Fan-out budget and depth", "none", [("vllm:saguaro_fanout_budget", "branches per request"),
                                              ("vllm:saguaro_draft_depth", "drafts per row")], ""),
        ("Steps per depth / s", "short", [
            (f"sum by (depth) (rate(vllm:saguaro_depth_steps_total{RATE}))", "depth {{depth}}")], ""),
        ("Pre-draft vs verification (p50)", "s", [
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:saguaro_predraft_seconds_bucket{RATE})))", "pre-draft"),
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:saguaro_verify_seconds_bucket{RATE})))", "verification"),
            (f"histogram_quantile(0.5, sum by (le) (rate(vllm:saguaro_late_seconds_bucket{RATE})))", "late")],
         "Pre-drafting hides drafting while it fits in the verification; `late` is on the critical path."),
        ("Rounds by mode / s", "short", [
            (f"sum by (mode) (rate(vllm:saguaro_rounds_total{RATE}))", "{{mode}}")],
         "SSD steps after a round that pre-drafted, or that was drafted as mode sync does (the fallback: "
         "pre-drafting could not pay on this workload)."),
        ("Pre-drafts skipped or cut short / s", "short", [
            (f"rate(vllm:saguaro_predraft_skipped_total{RATE})", "skipped"),
            (f"rate(vllm:saguaro_predraft_cut_short_total{RATE})", "cut short")], ""),
        ("Branch KV blocks / s", "short", [
            (f"sum by (kind) (rate(vllm:saguaro_branch_blocks_total{RATE}))", "{{kind}}")], ""),
        ("Sampled drafts and mean C", "short", [
            (f"sum by (scaled) (rate(vllm:saguaro_sampled_drafts_total{RATE}))", "scaled={{scaled}}"),
            (f"rate(vllm:saguaro_sampled_drafts_scale_total{RATE}) / sum(rate(vllm:saguaro_sampled_drafts_total{RATE}))",
             "mean C")], "Saguaro sampling: draft tokens by whether C < 1, and the mean C in use."),
        ("Proposal ring", "bytes", [("vllm:saguaro_proposal_ring_bytes", "reserved bytes"),
                                    (f"rate(vllm:saguaro_sampled_rows_capped_total{RATE})", "rows capped / s")],
         "Sampled rows' probabilities: the ring's reservation, and rows left without drafts for lack of ring rows."),
    ]),
]


def build() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for n, (title, unit, queries, description) in enumerate(row_panels):
            panels.append({
                "id": pid, "type": "timeseries", "title": title, "description": description,
                "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "gridPos": {"h": 8, "w": 8, "x": 8 * (n % 3), "y": y + 8 * (n // 3)},
                "targets": [{"refId": chr(ord("A") + i), "expr": q, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}}
                            for i, (q, legend) in enumerate(queries)],
            })
            pid += 1
        y += 8 * -(-len(row_panels) // 3)
    return {
        "title": "vLLM + Saguaro speculative decoding", "uid": "saguaro-vllm", "schemaVersion": 39, "version": 1,
        "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["vllm", "saguaro"],
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus"}],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "type": "datasource", "query": "prometheus", "label": "datasource"},
            {"name": "model_name", "type": "query", "label": "model", "includeAll": True, "multi": True,
             "datasource": {"type": "prometheus", "uid": "${DS_PROMETHEUS}"},
             "query": "label_values(vllm:spec_decode_num_drafts_total, model_name)", "refresh": 2}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
