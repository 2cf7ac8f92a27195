"""Saguaro projected on GPUs (issue 27, item 5): the demo pair's recorded `mode: async` traces replayed
through the product's own policy under each GPU cost model of `benchmarks/cost_models/` (written by
`gpu_cost_models.py` from public figures). A projection, not a measurement: no GPU ran any of it.

Per cost model and trace (one temperature each): tokens/s per sequence of vLLM AR, vLLM `draft_model`,
Saguaro `sync` and SSD at batch 1/4/16/64 (a batch > 1 repeats the trace's rows: their outcomes repeat), SSD's
hit rate and the fan-out budgets it chose, and the issue's bars (SSD >= 1.4x `sync` at batch 1 and T=0,
>= 1.25x at T=1; hit rate >= 0.8 / 0.6; SSD >= `sync` at every batch). Writes
`benchmarks/results/<date>-projection-gpu.json`, rendered on docs/benchmarks.md by report.py.

    .venv/bin/python benchmarks/project_gpu.py --traces DIR                 # every model
    .venv/bin/python benchmarks/project_gpu.py --traces DIR --models h100-70b-tp4-1b

DIR is a trace directory of `validate_projection.py` (`make bench` records them under
benchmarks/results/traces/, not tracked). SSD replays each trace's recorded options except the policy
defaults in POLICY_DEFAULTS, which take today's defaults (the traces of the results files were recorded
under the defaults of their day: `max_fanout_budget` 32, 64 from 2026-12-06, 128 since that evening);
`--recorded-options` replays the recorded ones.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from saguaro_vllm.drafter.trace import read_trace  # noqa: E402
from saguaro_vllm.frontend.config import SaguaroOptions  # noqa: E402
from saguaro_vllm.projection.cost_model import CostModel  # noqa: E402
from saguaro_vllm.projection.project import project_trace  # noqa: E402

#: Options the projection takes at today's defaults rather than as recorded.
POLICY_DEFAULTS = {name: SaguaroOptions.model_fields[name].default for name in ("max_fanout_budget",)}
BARS = {"ssd_over_sync_b1": {0.0: 1.4, 1.0: 1.25}, "hit_rate_b1": {0.0: 0.8, 1.0: 0.6}}


def bars(temp: float, rows: dict[int, dict[str, dict]]) -> dict:
    """The issue's bars for one trace's projection (`rows[batch][engine]`)."""
    b1 = rows[min(rows)]
    ratio = b1["saguaro-async"]["tokens_per_s"] / b1["saguaro-sync"]["tokens_per_s"]
    out = {"ssd_over_sync_b1": round(ratio, 3), "hit_rate_b1": b1["saguaro-async"].get("hit_rate"),
           "ssd_at_least_sync_every_batch": all(r["saguaro-async"]["tokens_per_s"] >= r["saguaro-sync"]["tokens_per_s"]
                                                for r in rows.values())}
    if temp in BARS["ssd_over_sync_b1"]:
        out["bar_ssd_over_sync_b1"] = BARS["ssd_over_sync_b1"][temp]
        out["bar_hit_rate_b1"] = BARS["hit_rate_b1"][temp]
        out["met"] = (ratio >= out["bar_ssd_over_sync_b1"] and (out["hit_rate_b1"] or 0) >= out["bar_hit_rate_b1"]
                      and out["ssd_at_least_sync_every_batch"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", required=True, help="a validate_projection.py trace directory (traces are not "
                   "tracked: `make bench` records them under benchmarks/results/traces/)")
    p.add_argument("--models", default="", help="cost model stems under benchmarks/cost_models/ (default: all)")
    p.add_argument("--trace-glob", default="async-b1-*/trace-*.jsonl.gz",
                   help="which traces of the directory (e.g. async-b1-*/trace-*.jsonl.gz: the batch-1 runs)")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--label", default="gpu")
    p.add_argument("--recorded-options", action="store_true",
                   help="replay the traces' recorded options (default: POLICY_DEFAULTS at today's defaults)")
    a = p.parse_args()
    models = sorted((ROOT / "cost_models").glob("*.json"))
    models = [m for m in models if m.stem != "authors-check" and (not a.models or m.stem in a.models.split(","))]
    traces = sorted(Path(a.traces).resolve().glob(a.trace_glob))
    if not models or not traces:
        raise SystemExit(f"nothing to project: {len(models)} cost models, {len(traces)} async traces under {a.traces}")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    results = []
    for model_path in tqdm(models, desc="cost models"):
        cost = CostModel.load(model_path)
        for trace in traces:
            header, steps = read_trace(trace)
            temps = collections.Counter(r.get("temp", 0.0) for s in steps for r in s["rows"])
            temp = temps.most_common(1)[0][0] if temps else 0.0  # the run's (a warm-up request may differ)
            report = project_trace(trace, cost, batches, options=None if a.recorded_options else POLICY_DEFAULTS)
            rows: dict[int, dict[str, dict]] = {}
            for row in report["projected"]:
                rows.setdefault(row["batch"], {})[row["engine"]] = row
            results.append({"cost_model": model_path.stem, "trace": str(trace.relative_to(ROOT.parent)),
                            "temperature": temp, "k": report["k"], "measured_here": report["measured"],
                            "projected": report["projected"], "bars": bars(temp, rows)})
    date = datetime.date.today().isoformat()
    out = ROOT / "results" / f"{date}-projection-{a.label}.json"
    authors = ROOT / "cost_models" / "authors-check.json"
    out.write_text(json.dumps({
        "kind": "projection", "date": date, "command": " ".join(["python"] + sys.argv),
        "note": "a projection under cost models from public figures, not a measurement; traces recorded on the "
                "2-core CPU machine with the cost-matched demo pair (batch 1, 256 tokens, K="
                + "/".join(str(k) for k in sorted({r["k"] for r in results})) + ")",
        "traces": a.traces, "options": "as recorded" if a.recorded_options else POLICY_DEFAULTS,
        "authors_check": json.loads(authors.read_text()) if authors.exists() else None,
        "results": results}, indent=1) + "\n")
    for r in results:
        b = r["bars"]
        print(f"{r['cost_model']:<20} T={r['temperature']:<4} SSD/sync at b1 {b['ssd_over_sync_b1']:.2f}, hit rate "
              f"{b['hit_rate_b1']}, SSD >= sync at every batch: {b['ssd_at_least_sync_every_batch']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
