"""The Grafana dashboard (docs/grafana/saguaro-dashboard.json): what scripts/make_dashboard.py writes, a
panel for every collector of saguaro_vllm/worker/metrics.py, and every query naming a metric that exists: vLLM's
spec-decode counters or one of ours under the name Prometheus exposes (counters `_total`, histograms
`_bucket`); the serve test (test_serve_features.py) checks the names against a running server's /metrics."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "saguaro-dashboard.json"
METRIC = re.compile(r"vllm:[a-z_]+")


def dashboard_metrics() -> set[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in METRIC.findall(e)}


def exported_names() -> set[str]:
    """The names our collectors put on /metrics (per type), from metrics.py itself."""
    from saguaro_vllm.worker import metrics

    names = set()
    for c in metrics._prometheus().values():
        kind = type(c).__name__
        suffixes = {"Counter": ["_total"], "Histogram": ["_bucket", "_sum", "_count"], "Gauge": [""]}[kind]
        names |= {c._name + s for s in suffixes}
    return names


def test_file_is_what_the_script_writes():
    spec = importlib.util.spec_from_file_location("make_dashboard", ROOT / "scripts" / "make_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run scripts/make_dashboard.py"


def test_every_collector_has_a_panel_and_every_query_names_a_real_metric():
    used = dashboard_metrics()
    ours = {m for m in used if m.startswith("vllm:saguaro_")}
    exported = exported_names()
    assert ours <= exported, sorted(ours - exported)
    from saguaro_vllm.worker import metrics

    families = {c._name for c in metrics._prometheus().values()}
    shown = {f for f in families if any(m.startswith(f) for m in ours)}
    assert shown == families, sorted(families - shown)
    vllm_side = used - ours
    assert vllm_side == {"vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
                         "vllm:spec_decode_num_drafts_total"}
