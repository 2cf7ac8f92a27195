"""`saguaro-vllm project`: traces + a cost model -> tokens per second of vLLM AR, vLLM `draft_model`,
Saguaro `sync` and SSD per batch size, SSD's hit rate per depth and its chosen fan-out and depth; JSON and a
plot. Per trace it also reports what the run measured and the replay under the run's own timings (which must
agree with it: the check that the replay is the product's policy)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from saguaro_vllm.drafter.trace import read_trace
from saguaro_vllm.projection.cost_model import CostModel, from_trace
from saguaro_vllm.projection.engines import (live_replay, measured, project_ar, project_spec, project_ssd,
                                             segment_starts, tile)

logger = logging.getLogger("saguaro_vllm.projection")
ENGINES = ("vllm-ar", "vllm-draft_model", "saguaro-sync", "saguaro-async")


def project_trace(path: str | Path, cost: CostModel | None, batch_sizes: list[int] | None = None,
                  seed: int = 0, last_group: bool = False, options: dict | None = None) -> dict:
    """One trace's report; `cost` None: the cost model fitted from the trace itself; `batch_sizes` None:
    the trace's own batch; `last_group`: count only the last group of requests (after e.g. a warm-up; the
    earlier steps are replayed for the policy's state); `options`: saguaro options the projected SSD
    replays instead of the recorded ones (e.g. a default changed since the trace was recorded; the live
    replay keeps the run's own)."""
    header, steps = read_trace(path)
    starts = segment_starts(steps)
    c = starts[-1] if last_group and starts else 0
    if len(steps) < 3:
        raise ValueError(f"{path}: {len(steps)} steps recorded; a projection needs at least 3")
    cost = cost or from_trace(header, steps)
    k = int(header.get("k") or max(r.get("nd", 0) for s in steps for r in s["rows"]))
    temps = sorted({r.get("temp", 0.0) for s in steps for r in s["rows"]})
    own_batch = round(sum(len(s["rows"]) for s in steps) / len(steps))
    report = {"trace": str(path), "mode": header.get("mode"), "k": k, "temperatures": temps,
              "count_from_step": c, "measured": measured(header, steps, c), "projected": []}
    if header.get("mode") == "async":
        report["live_replay"] = live_replay(header, steps, c)
    for b in batch_sizes or [own_batch]:
        tiled = steps if b == own_batch else tile(steps, b)
        report["projected"].append(project_ar(b, cost))
        report["projected"].append(project_spec("vllm-draft_model", tiled, k, cost, seed, c))
        report["projected"].append(project_spec("saguaro-sync", tiled, k, cost, seed, c))
        if header.get("mode") == "async":
            policy = {**header, "options": {**(header.get("options") or {}), **options}} if options else header
            report["projected"].append(project_ssd(policy, tiled, cost, seed, c))
    return report


def plot(runs: list[dict], path: Path) -> bool:
    """Tokens per second per sequence against batch size, one panel per trace. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install matplotlib)")
        return False
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.8), squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        for engine in ENGINES:
            pts = sorted((p["batch"], p["per_seq_tokens_per_s"]) for p in run["projected"] if p["engine"] == engine)
            if pts:
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=engine)
        m = run["measured"]
        ax.scatter([m["batch"]], [m["per_seq_tokens_per_s"]], marker="*", s=120, color="black",
                   label=f"measured ({m['engine']})", zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s per sequence")
        ax.set_title(f"{Path(run['trace']).name[:40]}\nT={','.join(map(str, run['temperatures']))} K={run['k']}",
                     fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("projection (a model, not a measurement)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_project(traces: list[str], cost_path: str | None, out: str, batch_sizes: list[int] | None,
                seed: int = 0, last_group: bool = False) -> dict:
    """The command: one report per trace into `out/projection.json`, and `out/projection.png`."""
    cost = CostModel.load(cost_path) if cost_path else None
    runs = [project_trace(t, cost, batch_sizes, seed, last_group) for t in traces]
    report = {"cost_model": cost.to_json() if cost else "fitted from each trace", "runs": runs}
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "projection.json").write_text(json.dumps(report, indent=1) + "\n")
    report["plot"] = str(out_dir / "projection.png") if plot(runs, out_dir / "projection.png") else None
    return report


def format_report(report: dict) -> str:
    lines = []
    for run in report["runs"]:
        m = run["measured"]
        lines.append(f"{run['trace']} ({run['mode']}, K={run['k']}, T={run['temperatures']}): measured "
                     f"{m['tokens_per_s']:.2f} tokens/s at batch {m['batch']}, hit rate {m.get('hit_rate')}")
        if "live_replay" in run:
            lr = run["live_replay"]
            lines.append(f"  replay under the run's own timings: {lr['tokens_per_s']:.2f} tokens/s, "
                         f"hit rate {lr['hit_rate']}")
        for p in run["projected"]:
            hit = f", hit rate {p['hit_rate']}, budgets {p['budget_chosen']}" if "hit_rate" in p else ""
            lines.append(f"  batch {p['batch']:>3} {p['engine']:<17} {p['tokens_per_s']:>9.2f} tokens/s "
                         f"({p['per_seq_tokens_per_s']:.2f} per sequence){hit}")
    return "\n".join(lines)
