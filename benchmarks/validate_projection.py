"""Validation of the projection on this machine (issue 27 item 3): record traces of real runs, calibrate this
machine's cost model, replay each trace under it, and compare with what the same run measured.

Per cell (mode x batch x temperature) one real run on the cost-matched demo pair (benchmarks/run.py's
worker, Saguaro's placement: target on core 0, drafter on core 1) with `saguaro.trace_dir`; then
`saguaro-vllm calibrate` (draft forward timed on core 1, the target's verification from a verify-curve JSON,
host overheads from the traces) and, per trace, its last group of requests (after the worker's warm-up):
- measured: the trace's own tokens/s over those steps (and the engine's decode tokens/s per sequence);
- replay under the run's own timings (`async`): must equal measured (a check of the replay itself);
- replay under the calibrated cost model: the projection; the bar is 10 % tokens/s and 0.05 hit rate.

    .venv/bin/python benchmarks/validate_projection.py --verify-curve benchmarks/results/2026-12-04-verify-curve.json
    .venv/bin/python benchmarks/validate_projection.py --batch-sizes 1,4,16 --temperatures 0,0.7,1.0
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import RESULTS, engine_specs, machine_info, run_one  # noqa: E402

from saguaro_vllm.drafter.trace import read_trace  # noqa: E402
from saguaro_vllm.projection.calibrate import jitter_from_traces  # noqa: E402
from saguaro_vllm.projection.cost_model import CostModel, from_trace  # noqa: E402
from saguaro_vllm.projection.clocks import TraceClock  # noqa: E402
from saguaro_vllm.projection.replay import SSDReplay  # noqa: E402
from saguaro_vllm.projection.engines import (live_replay, measured, project_spec, project_ssd,  # noqa: E402
                                             segment_starts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--temperatures", default="0,1.0")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--verify-curve", help="benchmarks/verify_curve.py JSON (default: measure one now for the "
                   "batch sizes, depths 0,1,3,5)")
    p.add_argument("--verify-from-traces", action="store_true", help="take the target's verification from the "
                   "traces (as the drafter saw it) instead of a verify curve")
    p.add_argument("--draft-forward-from", help="take the draft forward's fit from this cost model JSON (e.g. the "
                   "one stored with the traces) instead of the one timed now; the spread is re-measured over it")
    p.add_argument("--traces", help="trace directory: the cells it already holds are reused (their runs skipped), "
                   "the missing ones are run and kept there too")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--name", default="validate-projection")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. the machine's load)")
    return p.parse_args(argv)


def record(a, target: str, draft: str, prompts: list[str], trace_root: Path,
           have: set[tuple[str, int, float]] = frozenset()) -> list[dict]:
    """Run and trace every requested (mode, batch, T) cell not in `have`."""
    cells = []
    for mode in a.modes.split(","):
        for batch in map(int, a.batch_sizes.split(",")):
            for temp in map(float, a.temperatures.split(",")):
                if (mode, batch, temp) in have:
                    continue
                trace_dir = trace_root / f"{mode}-b{batch}-t{temp:g}"
                spec = engine_specs(draft, [], a.k, {}, [0], [1])[f"saguaro-{mode}"]
                spec["saguaro"]["trace_dir"] = str(trace_dir)
                res = run_one(target, spec, prompts[:batch], batch, temp, a.max_tokens, None, a.timeout)
                print(f"[run] {mode} batch {batch} T={temp:g}: {res['decode_tok_s_per_seq']:.2f} tokens/s per "
                      f"sequence, hit rate {res.get('hit_rate')}", flush=True)
                cells.append({"mode": mode, "batch": batch, "temperature": temp, "trace_dir": str(trace_dir),
                              "run": {k: res.get(k) for k in ("decode_tok_s_per_seq", "total_tok_s", "hit_rate",
                                                              "mean_acceptance_length")}})
    return cells


def trace_of(cell: dict) -> Path:
    files = sorted(Path(cell["trace_dir"]).glob("trace-*.jsonl.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise RuntimeError(f"no trace written under {cell['trace_dir']}")
    return files[-1]


def compare(cell: dict, cost: CostModel, k: int) -> dict:
    header, steps = read_trace(trace_of(cell))
    starts = segment_starts(steps)
    c = starts[-1] if starts else 0
    m = measured(header, steps, c)
    out = {**{x: cell[x] for x in ("mode", "batch", "temperature")}, "engine_run": cell["run"], "measured": m,
           "steps": len(steps) - c}
    own = from_trace(header, steps)  # the run's own cost model: isolates the replay from the machine's drift
    if header["mode"] == "async":
        out["live_replay"] = live_replay(header, steps, c)
        replayed = SSDReplay(header, steps, TraceClock(steps)).run().per_step
        out["live_statuses_equal"] = [s["status"] for s in replayed] == [[r["st"] for r in s["rows"]] for s in steps]
        proj = project_ssd(header, steps, cost, count_from=c)
        out["projected_own_costs"] = project_ssd(header, steps, own, count_from=c)
    else:
        proj = project_spec("saguaro-sync", steps, k, cost, count_from=c)
        out["projected_own_costs"] = project_spec("saguaro-sync", steps, k, own, count_from=c)
    out["projected"] = proj
    out["own_costs_error"] = round(out["projected_own_costs"]["tokens_per_s"] / m["tokens_per_s"] - 1, 4)
    out["tokens_error"] = round(proj["tokens_per_s"] / m["tokens_per_s"] - 1, 4) if m["tokens_per_s"] else None
    if m.get("hit_rate") is not None and proj.get("hit_rate") is not None:
        out["hit_rate_error"] = round(proj["hit_rate"] - m["hit_rate"], 4)
    out["within_bars"] = (out["tokens_error"] is not None and abs(out["tokens_error"]) <= 0.10
                          and abs(out.get("hit_rate_error", 0.0)) <= 0.05)
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from saguaro_vllm.demo.build import ensure_demo_pair

    pair = ensure_demo_pair(cost_matched=True)
    target, draft = str(pair.target_cost), str(pair.draft_cost)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    prompts = pair.heldout_prompts(max(batches))
    trace_root = Path(a.traces) if a.traces else Path(tempfile.mkdtemp(prefix="saguaro-traces-"))
    cells_file = trace_root / "cells.json"
    reused = bool(a.traces and cells_file.exists())
    cells = json.loads(cells_file.read_text()) if reused else []
    for cell in cells:  # the directory may have moved since (e.g. kept under benchmarks/results/traces/)
        cell["trace_dir"] = str(trace_root / Path(cell["trace_dir"]).name)
    added = record(a, target, draft, prompts, trace_root, {(c["mode"], c["batch"], c["temperature"]) for c in cells})
    if added:  # cells the directory did not hold yet (all of them for a new one)
        cells += added
        cells_file.write_text(json.dumps(cells, indent=1))
    wanted = {(m, int(b), float(t)) for m in a.modes.split(",") for b in a.batch_sizes.split(",")
              for t in a.temperatures.split(",")}
    cells = [c for c in cells if (c["mode"], c["batch"], c["temperature"]) in wanted]
    curve = a.verify_curve
    if curve is None and not a.verify_from_traces:
        subprocess.run([sys.executable, str(Path(__file__).parent / "verify_curve.py"), "--batch-sizes",
                        a.batch_sizes, "--depths", "0,1,3,5", "--max-tokens", "48"], check=True)
        curve = str(RESULTS / f"{datetime.date.today()}-verify-curve.json")
    # stored traces keep the cost model they were validated with; a re-validation's model is in its result
    cost_path = (Path(tempfile.mkdtemp(prefix="saguaro-cost-")) if reused else trace_root) / "cost-model.json"
    traces = [str(trace_of(c)) for c in cells]
    subprocess.run([sys.executable, "-m", "saguaro_vllm.tools.cli", "calibrate", "--draft", draft, "--core", "1",
                    *(["--verify-curve", curve] if curve else []), "--from-trace", *traces, "--out", str(cost_path)],
                   check=True)
    cost = CostModel.load(cost_path)
    if a.draft_forward_from:  # a timing of the draft taken at another time, with the spread over it
        stored = CostModel.load(a.draft_forward_from)
        cost.draft, cost.sources["draft_forward"] = stored.draft, stored.sources["draft_forward"]
        cost.jitter = jitter_from_traces(traces, cost)
    rows = [compare(c, cost, a.k) for c in cells]
    print(f"\n{'mode':<6} {'batch':>5} {'T':>4} | {'measured tok/s':>14} {'projected':>9} {'error':>7} | "
          f"{'hit measured':>12} {'projected':>9} | {'live replay':>11} | {'own costs':>9} {'error':>7} {'hit':>6}")
    for r in rows:
        m, p = r["measured"], r["projected"]
        live = r.get("live_replay", {})
        print(f"{r['mode']:<6} {r['batch']:>5} {r['temperature']:>4g} | {m['tokens_per_s']:>14.2f} "
              f"{p['tokens_per_s']:>9.2f} {100 * (r['tokens_error'] or 0):>6.1f}% | "
              f"{str(m.get('hit_rate', '-')):>12} {str(p.get('hit_rate', '-')):>9} | "
              f"{str(live.get('tokens_per_s', '-')):>11} | {r['projected_own_costs']['tokens_per_s']:>9.2f} "
              f"{100 * r['own_costs_error']:>6.1f}% {str(r['projected_own_costs'].get('hit_rate', '-')):>6}")
    out = {"kind": "validate-projection", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine_info(), "target": target, "draft": draft, "k": a.k, "max_tokens": a.max_tokens,
           "command": " ".join(sys.argv), "note": a.note, "verify_curve": curve, "traces": str(trace_root),
           "cost_model": cost.to_json(), "cells": rows}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{datetime.date.today()}-{a.name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"saved {path}")
    return 0 if all(r["within_bars"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
