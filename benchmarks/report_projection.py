"""The "Projected on GPUs" section of docs/benchmarks.md (called by report.py): first the validation of the
replay on this machine (`validate_projection.py`: projected vs measured), then the GPU projection
(`project_gpu.py`) beside the SSD paper's published figures and its sanity check (`gpu_cost_models.py`).
Labelled as a projection everywhere: no GPU ran any of it."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _newest(pattern: str) -> dict | None:
    files = sorted(RESULTS.glob(pattern))
    if not files:
        return None
    data = json.loads(files[-1].read_text())
    data["_file"] = files[-1].name
    return data


def result_link(name: str) -> str:
    """A results file as a link from docs/benchmarks.md."""
    return f"[{name}](../benchmarks/results/{name})"


def short_command(command: str, note: str | None) -> str:
    """The command as run, its `--note` text elided where the page shows the note beside it."""
    return command.replace(f" --note {note}", " --note ...") if note else command


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.1f} %"


def validation_lines(data: dict) -> list[str]:
    out = [f"**Validation on this machine** ({result_link(data['_file'])}; command "
           f"`{short_command(data.get('command', ''), data.get('note'))}`): each run's "
           "trace replayed with the cost model calibrated here (`saguaro-vllm calibrate`), against what the same "
           "run measured; bars: 10 % (tokens/s), 0.05 (hit rate). \"Own costs\": the replay under the cost model "
           "fitted from that run's own trace (isolates the replay from the calibration). "
           f"Machine: {data.get('machine', {}).get('cpu', '?')}. {data.get('note') or ''}".rstrip(),
           "", "| mode | batch | T | measured tok/s | projected (calibrated) | error | own costs | error | "
           "hit rate measured / projected | within bars |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        m, p, own = c["measured"], c["projected"], c.get("projected_own_costs", {})
        hits = (f"{m.get('hit_rate')} / {p.get('hit_rate')}" if c["mode"] == "async" else "-")
        out.append(f"| {c['mode']} | {c['batch']} | {c['temperature']:g} | {m['tokens_per_s']:.2f} | "
                   f"{p['tokens_per_s']:.2f} | {_pct(c.get('tokens_error'))} | {own.get('tokens_per_s', '-')} | "
                   f"{_pct(c.get('own_costs_error'))} | {hits} | {'yes' if c.get('within_bars') else 'no'} |")
    within = sum(1 for c in data["cells"] if c.get("within_bars"))
    out += ["", f"{within} of {len(data['cells'])} cells within the bars. Calibrated from "
            f"{data.get('calibrated_from', 'the validated traces')}"
            + (" (" + ", ".join(f"{c['mode']} b{c['batch']} T={c['temperature']:g}" for c in data["calibration"])
               + ")" if data.get("calibration") else "") + "."]
    ar = data.get("vllm_ar") or []
    if ar:
        out += ["", "vLLM AR (T=0, pinned to core 0) measured and projected from the verify curve's depth 0, and "
                "whether it is ahead of each Saguaro mode (tokens/s per sequence) in the runs and in the projection "
                "(in brackets the mode's own, measured / projected: each request's tokens over its own span, as the "
                "engine counts them):",
                "", "| batch | AR measured | AR projected | error | AR ahead of sync (measured / projected) | "
                "AR ahead of SSD (measured / projected) |", "|---|---|---|---|---|---|"]
        for x in ar:
            ahead = {m: f"{'yes' if v['measured'] else 'no'} / {'yes' if v['projected'] else 'no'}"
                     + (f" ({v['measured_per_seq']:.2f} / {v['projected_per_seq']:.2f})"
                        if v.get("projected_per_seq") is not None else "")
                     for m, v in x["ahead_of"].items()}
            out.append(f"| {x['batch']} | {x['measured_per_seq']:.2f} | {x['projected_per_seq']:.2f} | "
                       f"{_pct(x['error'])} | {ahead.get('sync', '-')} | {ahead.get('async', '-')} |")
    return out + [""]


def repeatability_lines(data: dict) -> list[str]:
    """`repeatability.py`: the same cells run more than once here, against the validation's bars."""
    out = [f"**Repeatability of the measurement** ({result_link(data['_file'])}; command "
           f"`{short_command(data.get('command', ''), data.get('note'))}`): the "
           "same cells (same code, prompts and settings) run again on this machine, each run measured like the "
           "validation's; a cell whose runs differ by more than the bars cannot be projected within them from any "
           f"one run. Machine: {data.get('machine', {}).get('cpu', '?')}. {data.get('note') or ''}".rstrip(), "",
           "| mode | batch | T | runs | tokens/s | spread | hit rates | range | runs within the bars of each other "
           "| projected: error against the runs' mean (tokens/s; hit rate) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        tokens = ", ".join(f"{x['tokens_per_s']:.2f}" for x in c["measured"])
        hits = ", ".join(f"{x['hit_rate']:.3f}" for x in c["measured"] if x.get("hit_rate") is not None) or "-"
        p = c.get("projected")
        versus = "-" if p is None else (f"{_pct(p['error_vs_mean'])}"
                                         + (f"; {p['hit_rate_error_vs_mean']:+.3f}" if "hit_rate_error_vs_mean" in p else "")
                                         + (" (within)" if p["within_bars"] else ""))
        out.append(f"| {c['mode']} | {c['batch']} | {c['temperature']:g} | {c['runs']} | {tokens} | "
                   f"{_pct(c.get('tokens_spread'))} | {hits} | {c.get('hit_rate_range', '-')} | "
                   f"{'yes' if c.get('within_bars') else 'no'} | {versus} |")
    within = sum(1 for c in data["cells"] if c.get("within_bars"))
    out += ["", f"{within} of {len(data['cells'])} cells repeat within the bars."]
    versus = data.get("against_validation")
    if versus:
        out[-1] += (" Against the mean of each cell's runs, the projection of "
                    f"{result_link(versus['validation'])} is within "
                    f"the bars in {versus['within_bars']} of {versus['cells']} cells.")
    return out + [""]


def _batches(data: dict) -> list[int]:
    return sorted({p["batch"] for r in data["results"] for p in r["projected"]})


def projection_lines(data: dict) -> list[str]:
    """One row per cost model and temperature, every batch in one cell, so the table stays one screen."""
    out = [f"**Projection** ({result_link(data['_file'])}; command `{data['command']}`): {data['note']}. Tokens/s per "
           "sequence; a batch above 1 repeats the trace's rows. Each cell lists batch "
           + " / ".join(str(b) for b in _batches(data)) + ".", "",
           "| cost model | T | vLLM AR | vLLM draft_model | Saguaro sync | SSD | SSD / sync | SSD hit rate |",
           "|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        rows: dict[int, dict[str, dict]] = {}
        for p in r["projected"]:
            rows.setdefault(p["batch"], {})[p["engine"]] = p
        cells = [rows[b] for b in sorted(rows)]

        def col(engine: str) -> str:
            return " / ".join(f"{e[engine]['per_seq_tokens_per_s']:.1f}" for e in cells)

        ratio = " / ".join(f"{e['saguaro-async']['tokens_per_s'] / e['saguaro-sync']['tokens_per_s']:.2f}" for e in cells)
        hits = " / ".join("-" if e["saguaro-async"].get("hit_rate") is None else f"{e['saguaro-async']['hit_rate']:.2f}"
                          for e in cells)
        out.append(f"| {r['cost_model']} | {r['temperature']:g} | {col('vllm-ar')} | {col('vllm-draft_model')} | "
                   f"{col('saguaro-sync')} | {col('saguaro-async')} | {ratio} | {hits} |")
    out += ["", "Bars of the projection issue (H100, 70B TP4 + 1B): SSD >= 1.4x `sync` at batch 1 and T=0 (>= 1.25x "
            "at T=1), hit rate >= 0.8 (0.6), SSD >= `sync` at every batch:", ""]
    for r in data["results"]:
        b = r["bars"]
        if r["cost_model"] != "h100-70b-tp4-1b" or "met" not in b:
            continue
        out.append(f"- T={r['temperature']:g}: SSD/sync {b['ssd_over_sync_b1']} (bar {b['bar_ssd_over_sync_b1']}), "
                   f"hit rate {b['hit_rate_b1']} (bar {b['bar_hit_rate_b1']}), SSD >= sync at every batch: "
                   f"{b['ssd_at_least_sync_every_batch']}: **{'met' if b['met'] else 'missed'}**")
    check = data.get("authors_check")
    if check:
        out += ["", f"**Sanity check against the authors' table** ({check['source']}), under the H100 70B TP4 + 1B "
                f"cost model with acceptance {check['alpha_from_sd']} (the one that reproduces their SD figure; "
                "AR is the cost model's anchor):", "", "| figure | paper | projected | ratio | role |",
                "|---|---|---|---|---|"]
        for key, v in check.items():
            if isinstance(v, dict) and "paper" in v:
                out.append(f"| {key} | {v['paper']} | {v['projected']} | {v['ratio']} | {v.get('role', '')} |")
    return out + [""]


def newest_validation() -> dict | None:
    """The newest `validate_projection.py` result by its date (names carry the run's cells and settings)."""
    found = [json.loads(f.read_text()) | {"_file": f.name} for f in RESULTS.glob("*-validate-projection*.json")
             if "scratch" not in f.name]
    found = [d for d in found if d.get("cells")]
    return max(found, key=lambda d: d.get("date", "")) if found else None


INTRO = ["## Projection", "", "GPU figures projected from CPU runs (a projection, not a measurement).", "",
         "No GPU ran any of this. Recorded runs are replayed through the product's own policy code under "
         "another cost model ([projection.md](projection.md)); the replay is believed only as far as the "
         "validation reproduces what this machine measured.", ""]


def summary(detail: str) -> list[str]:
    """The benchmarks page's part: how far the validation and the repeatability runs hold (their tables in
    full on `detail`), then the projection itself."""
    validation, projection = newest_validation(), _newest("*-projection-gpu.json")
    repeat = _newest("*-repeatability*.json")
    if validation is None and projection is None:
        return []
    out = list(INTRO)
    if validation is not None:
        within = sum(1 for c in validation["cells"] if c.get("within_bars"))
        out.append(f"- Validation on this machine ({result_link(validation['_file'])}): the replay within the "
                   f"bars (10 % tokens/s, 0.05 hit rate) of what each run measured in {within} of "
                   f"{len(validation['cells'])} cells.")
    if repeat is not None:
        within = sum(1 for c in repeat["cells"] if c.get("within_bars"))
        out.append(f"- Repeatability ({result_link(repeat['_file'])}): runs of the same cell within the bars of "
                   f"each other in {within} of {len(repeat['cells'])} cells.")
    out += [f"- Both tables in full, with vLLM AR measured and projected: [{detail}]({detail}).", ""]
    if projection is not None:
        out += projection_lines(projection)
    deeper = _newest("*-projection-gpu-k8.json")
    if deeper is not None:
        out += [f"The same projection from traces recorded with 8 drafts per row: {result_link(deeper['_file'])}.",
                ""]
    return out


def detail() -> list[str]:
    """The validation and repeatability tables in full (a developer page; links relative to docs/)."""
    validation, repeat = newest_validation(), _newest("*-repeatability*.json")
    out = []
    if validation is not None:
        out += validation_lines(validation)
    if repeat is not None:
        out += repeatability_lines(repeat)
    return out


def section() -> list[str]:
    validation, projection = newest_validation(), _newest("*-projection-gpu.json")
    deeper = _newest("*-projection-gpu-k8.json")
    if validation is None and projection is None:
        return []
    out = ["## Projection", "", "GPU figures projected from CPU runs (a projection, not a measurement).", "",
           "No GPU ran any of this. Recorded runs are replayed through the product's own policy code under "
           "another cost model ([projection.md](projection.md)); the replay is believed only as far as the "
           "validation below reproduces what this machine measured.", ""]
    if validation is not None:
        out += validation_lines(validation)
    repeat = _newest("*-repeatability*.json")
    if repeat is not None:
        out += repeatability_lines(repeat)
    if projection is not None:
        out += projection_lines(projection)
    if deeper is not None:  # its table is in the result file; the page names it only
        out += [f"The same projection from traces recorded with 8 drafts per row: {result_link(deeper['_file'])}.",
                ""]
    return out
