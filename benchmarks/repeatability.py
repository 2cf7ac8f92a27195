"""How far this machine repeats its own measurements: the same cells (mode x batch x temperature, same prompts,
same code) recorded more than once, each run's tokens/s and hit rate as `validate_projection.py` measures
them, and their spread per cell.

The projection's validation asks the replay to land within 10 % (tokens/s) and 0.05 (hit rate) of one run;
where two runs of the same cell differ by more than that, a miss in that cell says as much about the machine
as about the replay. Each trace directory is one set of runs (`validate_projection.py --record-only --traces
DIR`, or the traces of a validation); a cell counts where at least two directories hold it. With
`--validation` the validation's projection of each cell is also set against the mean of the cell's runs.

    .venv/bin/python benchmarks/validate_projection.py --batch-sizes 1,4,16 --temperatures 0,0.7,1.0 \\
        --max-tokens 256 --record-only --traces benchmarks/results/traces/2026-12-07-demo-pair-b1b4b16-256-branchcost-repeat
    .venv/bin/python benchmarks/repeatability.py --traces \\
        benchmarks/results/traces/2026-12-07-demo-pair-b1b4b16-256-branchcost \\
        benchmarks/results/traces/2026-12-07-demo-pair-b1b4b16-256-branchcost-repeat \\
        --validation benchmarks/results/2026-12-07-validate-projection-b1b4b16-256-branchcost.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import RESULTS, machine_info, run_date  # noqa: E402
from validate_projection import stored_cells, trace_of  # noqa: E402

from saguaro_vllm.drafter.trace import read_trace  # noqa: E402
from saguaro_vllm.projection.engines import measured, segment_starts  # noqa: E402

#: The validation's bars, for the comparison of a cell's runs with each other.
TOKENS_BAR = 0.10
HIT_BAR = 0.05


def runs_of(root: Path) -> list[dict]:
    """Every cell a trace directory holds, measured like `validate_projection.compare` (the last group of
    requests, after the worker's warm-up)."""
    out = []
    for cell in stored_cells(root):
        header, steps = read_trace(trace_of(cell))
        starts = segment_starts(steps)
        m = measured(header, steps, starts[-1] if starts else 0)
        out.append({"mode": cell["mode"], "batch": cell["batch"], "temperature": cell["temperature"],
                    "traces": str(root), "created": header.get("created"), "tokens_per_s": m["tokens_per_s"],
                    "hit_rate": m.get("hit_rate")})
    return out


def spread(runs: list[dict]) -> dict:
    """A cell's runs against each other: the largest tokens/s over the smallest (- 1), the range of the hit
    rates, and whether both are within the validation's bars."""
    tokens = [r["tokens_per_s"] for r in runs]
    hits = [r["hit_rate"] for r in runs if r["hit_rate"] is not None]
    out = {"runs": len(runs), "tokens_per_s_mean": round(statistics.mean(tokens), 3),
           "tokens_spread": round(max(tokens) / min(tokens) - 1, 4) if min(tokens) > 0 else None}
    if len(hits) >= 2:
        out["hit_rate_mean"] = round(statistics.mean(hits), 4)
        out["hit_rate_range"] = round(max(hits) - min(hits), 4)
    out["within_bars"] = ((out["tokens_spread"] or 0.0) <= TOKENS_BAR and out.get("hit_rate_range", 0.0) <= HIT_BAR)
    return out


def against_validation(rows: list[dict], validation: dict) -> dict:
    """A validation's projection of each cell (from one of these runs' traces, calibrated on other runs)
    against the mean of the cell's runs: the error the projection has against this machine's own level rather
    than against one draw of it. Adds `projected` per cell; returns the count within the bars."""
    projected = {(c["mode"], c["batch"], c["temperature"]): c["projected"] for c in validation["cells"]}
    within = 0
    for r in rows:
        p = projected.get((r["mode"], r["batch"], r["temperature"]))
        if p is None:
            continue
        error = p["tokens_per_s"] / r["tokens_per_s_mean"] - 1
        out = {"tokens_per_s": p["tokens_per_s"], "error_vs_mean": round(error, 4)}
        if p.get("hit_rate") is not None and r.get("hit_rate_mean") is not None:
            out["hit_rate"] = p["hit_rate"]
            out["hit_rate_error_vs_mean"] = round(p["hit_rate"] - r["hit_rate_mean"], 4)
        out["within_bars"] = abs(error) <= TOKENS_BAR and abs(out.get("hit_rate_error_vs_mean", 0.0)) <= HIT_BAR
        within += out["within_bars"]
        r["projected"] = out
    return {"validation": validation.get("_file"), "cells": sum(1 for r in rows if "projected" in r),
            "within_bars": within}


def cells(roots: list[Path]) -> list[dict]:
    by_cell: dict[tuple, list[dict]] = {}
    for root in roots:
        for run in runs_of(root):
            by_cell.setdefault((run["mode"], run["batch"], run["temperature"]), []).append(run)
    return [{"mode": m, "batch": b, "temperature": t, **spread(runs), "measured": runs}
            for (m, b, t), runs in sorted(by_cell.items()) if len(runs) >= 2]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.5), sharey=True)
    labels = [f"{r['mode']} b{r['batch']} T={r['temperature']:g}" for r in rows]
    for i, r in enumerate(rows):
        tokens = [x["tokens_per_s"] / r["tokens_per_s_mean"] - 1 for x in r["measured"]]
        axes[0].scatter([100 * t for t in tokens], [i] * len(tokens), color="tab:blue")
        hits = [x["hit_rate"] for x in r["measured"] if x["hit_rate"] is not None]
        if hits:
            axes[1].scatter(hits, [i] * len(hits), color="tab:orange")
    axes[0].axvspan(-100 * TOKENS_BAR / 2, 100 * TOKENS_BAR / 2, color="0.9", zorder=0)
    axes[0].set_xlabel(f"tokens/s against the cell's mean (%; shaded: runs within {100 * TOKENS_BAR:.0f} % of each other)")
    axes[1].set_xlabel("hit rate")
    axes[0].set_yticks(range(len(rows)), labels)
    fig.suptitle("The same cell run again on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", nargs="+", required=True, help="trace directories (each with its cells.json)")
    p.add_argument("--validation", help="a validate_projection.py result whose cells these runs repeat: its "
                   "projection against the mean of each cell's runs")
    p.add_argument("--name", default="repeatability")
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    rows = cells([Path(t) for t in a.traces])
    if not rows:
        print("no cell is held by two of the directories", file=sys.stderr)
        return 1
    print(f"{'mode':<6} {'batch':>5} {'T':>4} | {'runs':>4} {'tokens/s':>30} {'spread':>7} | {'hit rates':>24} {'range':>6}")
    for r in rows:
        tokens = " ".join(f"{x['tokens_per_s']:.2f}" for x in r["measured"])
        hits = " ".join(f"{x['hit_rate']:.3f}" for x in r["measured"] if x["hit_rate"] is not None) or "-"
        print(f"{r['mode']:<6} {r['batch']:>5} {r['temperature']:>4g} | {r['runs']:>4} {tokens:>30} "
              f"{100 * (r['tokens_spread'] or 0):>6.1f}% | {hits:>24} {r.get('hit_rate_range', '-')!s:>6}")
    versus = None
    if a.validation:
        validation = json.loads(Path(a.validation).read_text()) | {"_file": Path(a.validation).name}
        versus = against_validation(rows, validation)
        print(f"{versus['validation']}: {versus['within_bars']} of {versus['cells']} cells' projections within the "
              "bars of their runs' mean")
    out = {"kind": "repeatability", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine_info(), "command": " ".join(sys.argv), "note": a.note,
           "bars": {"tokens": TOKENS_BAR, "hit_rate": HIT_BAR}, "traces": a.traces, "cells": rows,
           **({"against_validation": versus} if versus else {})}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{run_date()}-{a.name}.json"
    path.write_text(json.dumps(out, indent=1))
    plot(rows, path.with_suffix(".png"))
    print(f"saved {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
