"""Validation of the projection on this machine (issue 27 item 3): record traces of real runs, calibrate this
machine's cost model, replay each trace under it, and compare with what the same run measured.

Per cell (mode x batch x temperature) one real run on the cost-matched demo pair (benchmarks/run.py's
worker, Saguaro's placement: target on core 0, drafter on core 1) with `saguaro.trace_dir`. Calibration runs
(`--calibration-temperatures`, both modes, every batch) trace the same engines on *other* prompts (the next
held-out ones) into `calibration/`; then `saguaro-vllm calibrate` (draft forward timed on core 1, the
target's verification from a verify-curve JSON with its factor per temperature and batch, host overheads and
spread, all from the calibration traces: the validated runs are only replayed) and, per validated trace, its
last group of requests (after the worker's warm-up):
- measured: the trace's own tokens/s over those steps (and the engine's decode tokens/s per sequence);
- replay under the run's own timings (`async`): must equal measured (a check of the replay itself);
- replay under the calibrated cost model: the projection; the bar is 10 % tokens/s and 0.05 hit rate.
vLLM AR is run too (`--ar-batch-sizes`, T=0, pinned to core 0) and projected from the verify curve's depth 0:
where it beats `sync` and SSD (the crossover) in the runs and in the projection.

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
from run import RESULTS, engine_specs, machine_info, run_date, run_one  # noqa: E402

from saguaro_vllm.drafter.trace import read_trace  # noqa: E402
from saguaro_vllm.projection.calibrate import jitter_from_traces  # noqa: E402
from saguaro_vllm.projection.cost_model import CostModel, from_trace  # noqa: E402
from saguaro_vllm.projection.clocks import TraceClock  # noqa: E402
from saguaro_vllm.projection.replay import SSDReplay  # noqa: E402
from saguaro_vllm.projection.engines import (live_replay, measured, project_ar, project_spec,  # noqa: E402
                                             project_ssd, segment_starts)


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
    p.add_argument("--calibration-temperatures", default="0,1.0",
                   help="temperatures of the calibration runs (other prompts; '' : calibrate from the validated "
                   "traces themselves, as until 2026-12-06)")
    p.add_argument("--ar-batch-sizes", default="", help="batch sizes to run vLLM AR at (T=0) for the crossover")
    p.add_argument("--ar-from", help="an earlier result of this script: its measured vLLM AR runs instead of new ones")
    p.add_argument("--record-only", action="store_true", help="record the cells' traces (e.g. for "
                   "project_gpu.py) and stop: no calibration, no replay, no result file")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--name", default="validate-projection")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. the machine's load)")
    return p.parse_args(argv)


def record(a, target: str, draft: str, prompts: list[str], trace_root: Path,
           have: set[tuple[str, int, float]] = frozenset(), temperatures: str | None = None) -> list[dict]:
    """Run and trace every requested (mode, batch, T) cell not in `have`."""
    cells = []
    for mode in a.modes.split(","):
        for batch in map(int, a.batch_sizes.split(",")):
            for temp in map(float, (temperatures or a.temperatures).split(",")):
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


def stored_cells(root: Path) -> list[dict]:
    """The cells a trace directory's cells.json lists (none without one), their trace directories under
    `root` (the directory may have moved since, e.g. copied into tests/fixtures/traces/)."""
    cells_file = root / "cells.json"
    cells = json.loads(cells_file.read_text()) if cells_file.exists() else []
    for cell in cells:
        cell["trace_dir"] = str(root / Path(cell["trace_dir"]).name)
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


def ar_row(ar: dict, cost: CostModel, rows: list[dict]) -> dict:
    """vLLM AR at one batch, T=0: measured against projected, and whether it is ahead of each Saguaro mode
    (tokens/s per sequence; measured: the engines' own decode figures, like for like; projected: each
    request's tokens over its own span, `per_request_rate`, as the engine counts them) in the runs and in
    the projection: the crossover must come out the same."""
    projected = project_ar(ar["batch"], cost)["per_seq_tokens_per_s"]
    out = {"batch": ar["batch"], "measured_per_seq": ar["decode_tok_s_per_seq"], "projected_per_seq": projected,
           "error": round(projected / ar["decode_tok_s_per_seq"] - 1, 4), "ahead_of": {}}
    for r in rows:
        if r["batch"] == ar["batch"] and r["temperature"] == 0:
            mine = {"measured_per_seq": round(r["engine_run"]["decode_tok_s_per_seq"], 3),
                    "projected_per_seq": r["projected"]["per_request_tokens_per_s"]}
            out["ahead_of"][r["mode"]] = {"measured": ar["decode_tok_s_per_seq"] > mine["measured_per_seq"],
                                          "projected": projected > mine["projected_per_seq"], **mine}
    out["agrees"] = all(v["measured"] == v["projected"] for v in out["ahead_of"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from saguaro_vllm.demo.build import ensure_demo_pair

    pair = ensure_demo_pair(cost_matched=True)
    target, draft = str(pair.target_cost), str(pair.draft_cost)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    prompts = pair.heldout_prompts(2 * max(batches))  # the first half validated, the second calibrates
    trace_root = Path(a.traces) if a.traces else Path(tempfile.mkdtemp(prefix="saguaro-traces-"))
    trace_root.mkdir(parents=True, exist_ok=True)
    reused = bool(a.traces and (trace_root / "cells.json").exists())

    def cells_in(root: Path, group: list[str], temperatures: str) -> list[dict]:
        """The cells `root` holds (run now where missing), those asked for."""
        cells_file = root / "cells.json"
        cells = stored_cells(root)
        added = record(a, target, draft, group, root, {(c["mode"], c["batch"], c["temperature"]) for c in cells},
                       temperatures)
        if added:  # cells the directory did not hold yet (all of them for a new one)
            cells += added
            root.mkdir(parents=True, exist_ok=True)
            cells_file.write_text(json.dumps(cells, indent=1))
        wanted = {(m, int(b), float(t)) for m in a.modes.split(",") for b in a.batch_sizes.split(",")
                  for t in temperatures.split(",")}
        return [c for c in cells if (c["mode"], c["batch"], c["temperature"]) in wanted]

    cells = cells_in(trace_root, prompts[: max(batches)], a.temperatures)
    if a.record_only:
        print(f"recorded {len(cells)} cell(s) under {trace_root}")
        return 0
    calibration = (cells_in(trace_root / "calibration", prompts[max(batches):], a.calibration_temperatures)
                   if a.calibration_temperatures else [])
    ar = ([{k: x[k] for k in ("batch", "decode_tok_s_per_seq")} | {"measured_in": Path(a.ar_from).name}
           for x in [{"batch": y["batch"], "decode_tok_s_per_seq": y["measured_per_seq"]}
                     for y in json.loads(Path(a.ar_from).read_text()).get("vllm_ar", [])]] if a.ar_from else [])
    for batch in [] if a.ar_from else [int(b) for b in a.ar_batch_sizes.split(",") if b]:
        res = run_one(target, None, prompts[:batch], batch, 0.0, a.max_tokens, [0], a.timeout)
        print(f"[run] vllm-ar batch {batch} T=0: {res['decode_tok_s_per_seq']:.2f} tokens/s per sequence", flush=True)
        ar.append({"batch": batch, "decode_tok_s_per_seq": res["decode_tok_s_per_seq"]})
    curve = a.verify_curve
    if curve is None and not a.verify_from_traces:
        subprocess.run([sys.executable, str(Path(__file__).parent / "verify_curve.py"), "--batch-sizes",
                        a.batch_sizes, "--depths", "0,1,3,5", "--max-tokens", "48"], check=True)
        curve = str(RESULTS / f"{run_date()}-verify-curve.json")
    # stored traces keep the cost model they were validated with; a re-validation's model is in its result
    cost_path = (Path(tempfile.mkdtemp(prefix="saguaro-cost-")) if reused else trace_root) / "cost-model.json"
    traces = [str(trace_of(c)) for c in (calibration or cells)]
    subprocess.run([sys.executable, "-m", "saguaro_vllm.tools.cli", "calibrate", "--draft", draft, "--core", "1",
                    *(["--verify-curve", curve] if curve else []), "--from-trace", *traces, "--out", str(cost_path)],
                   check=True)
    cost = CostModel.load(cost_path)
    if a.draft_forward_from:  # a timing of the draft taken at another time, with the spread over it
        stored = CostModel.load(a.draft_forward_from)
        cost.draft, cost.sources["draft_forward"] = stored.draft, stored.sources["draft_forward"]
        cost.branch = stored.branch
        if stored.branch is not None:
            cost.sources["branch_forward"] = stored.sources["branch_forward"]
        cost.jitter = jitter_from_traces(traces, cost)
    rows = [compare(c, cost, a.k) for c in cells]
    crossover = [ar_row(x, cost, rows) for x in ar]
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
    for x in crossover:
        print(f"vllm-ar batch {x['batch']}: measured {x['measured_per_seq']:.2f} tokens/s per sequence, projected "
              f"{x['projected_per_seq']:.2f} ({100 * x['error']:.1f} %); AR ahead of "
              + ", ".join(f"{m}: measured {v['measured']}, projected {v['projected']}" for m, v in x["ahead_of"].items()))
    out = {"kind": "validate-projection", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine_info(), "target": target, "draft": draft, "k": a.k, "max_tokens": a.max_tokens,
           "command": " ".join(sys.argv), "note": a.note, "verify_curve": curve, "traces": str(trace_root),
           "cost_model": cost.to_json(), "cells": rows, "vllm_ar": crossover,
           "calibration": [{k: c[k] for k in ("mode", "batch", "temperature", "run")} for c in calibration],
           "calibrated_from": "calibration runs on other prompts" if calibration else "the validated traces"}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{run_date()}-{a.name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"saved {path}")
    return 0 if all(r["within_bars"] for r in rows) and all(x["agrees"] for x in crossover) else 1


if __name__ == "__main__":
    sys.exit(main())
