"""Turn `benchmarks/results/*.json` (from run.py) into `docs/benchmarks.md` and PNG plots in `docs/img/`.

One section per question (speed against `sync` and `draft_model`, temperature, batch, cost regimes, real
vocabularies, serving, host overhead, projection, soak), each from the newest result that answers it; older
results stay in git history. Everything on the page is computed from the results; hand-written analysis and
lab notes live in `benchmarks/notes.md`, not on the page. `tests/test_bench_report.py` fails when the page
differs from what this writes.

    .venv/bin/python benchmarks/report.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # report_projection beside it
from report_projection import result_link, short_command  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
NOTES = ROOT / "benchmarks" / "notes.md"
PAGE = ROOT / "docs" / "benchmarks.md"
#: The projection's validation and repeatability tables in full (for contributors; the page summarises them).
DEV_PAGE = ROOT / "docs" / "dev" / "projection-runs.md"
IMG = ROOT / "docs" / "img"
ORDER = ["vllm-ar", "vllm-draft_model", "saguaro-sync", "saguaro-async"]
LABEL = {"vllm-ar": "vLLM AR", "vllm-draft_model": "vLLM `draft_model`", "saguaro-sync": "Saguaro `sync`",
         "saguaro-async": "Saguaro `async` (SSD)"}


def load_latest() -> list[dict]:
    """The newest end-to-end result file of each name (files of other shapes, e.g. ops timings, skipped)."""
    latest: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if "name" not in data or not data.get("results") or "engine" not in data["results"][0]:
            continue
        if data.get("kind") == "transport":  # bench_transport.py: its own section
            continue
        data["_file"] = path.name
        if data["name"] not in latest or data["date"] >= latest[data["name"]]["date"]:
            latest[data["name"]] = data
    return sorted(latest.values(), key=lambda d: d["name"])


def model_dir(path: str) -> str:
    """A model directory as the page names it: its last two parts (the demo pair's cache key and the model),
    not the path on the machine that ran it."""
    return "/".join(Path(path).parts[-2:])


def placement_rule(placement: dict) -> str:
    """The rule of the placement a result ran: its `rule` text describes every placement (`split: ...; equal:
    ...`); the page keeps the one used and what holds for all."""
    other = [f"{mode}:" for mode in ("split", "equal") if mode != placement["mode"]]
    return "; ".join(part for part in placement["rule"].split("; ") if not part.startswith(tuple(other)))


def family(engine: str) -> str:
    return engine.rsplit("-k", 1)[0] if engine.startswith("vllm-draft_model-k") else engine


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table_rows(data: dict) -> dict[tuple[int, float], dict[str, dict]]:
    """(batch, temperature) -> engine family -> figures averaged over rounds; `vllm-draft_model` is its
    best K (by decode tokens/s per sequence), with that K noted."""
    cells: dict[tuple[int, float], dict[str, list[dict]]] = {}
    for r in data["results"]:
        cells.setdefault((r["batch"], r["temperature"]), {}).setdefault(r["engine"], []).append(r)
    out = {}
    for case, engines in sorted(cells.items()):
        row: dict[str, dict] = {}
        for engine, runs in engines.items():
            fig = {k: mean(r.get(k) for r in runs) for k in (
                "decode_tok_s_per_seq", "total_tok_s", "ttft_s", "mean_acceptance_length", "acceptance_rate",
                "hit_rate", "predraft_ms", "verify_ms", "drafter_wait_ms")}
            fig["engine"] = engine
            fig["peak_mb"] = mean(sum((r.get("peak_memory_mb") or {}).values()) or None for r in runs)
            fig["backups"] = runs[-1].get("backups")
            fam = family(engine)
            if fam not in row or (fig["decode_tok_s_per_seq"] or 0) > (row[fam]["decode_tok_s_per_seq"] or 0):
                row[fam] = fig
        out[case] = row
    return out


def ratio_ci(a: list[float], b: list[float], n_boot: int = 4000, seed: int = 0,
             level: float = 0.95) -> tuple[float, float, float] | None:
    """mean(a) / mean(b) with a paired bootstrap interval over requests (a[i] and b[i]: the same prompt,
    seed and round in two engines). None with fewer than 2 pairs."""
    import random

    n = min(len(a), len(b))
    if n < 2 or not sum(b[:n]):
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(n_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        den = sum(b[i] for i in idx)
        if den:
            ratios.append(sum(a[i] for i in idx) / den)
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * len(ratios))]
    hi = ratios[min(len(ratios) - 1, int((1 + level) / 2 * len(ratios)))]
    return sum(a[:n]) / sum(b[:n]), lo, hi


def paired_speeds(data: dict, engine: str, batch: int, t: float) -> list[float]:
    """Per-request tokens/s of one engine in one cell, ordered by (round, prompt) so engines pair up."""
    runs = sorted((r for r in data["results"] if family(r["engine"]) == engine and r["batch"] == batch
                   and r["temperature"] == t and r.get("per_seq_tok_s")), key=lambda r: r["round"])
    if engine == "vllm-draft_model" and runs:  # the best K only, as in the tables
        best = max({r["engine"] for r in runs}, key=lambda e: mean(
            r["decode_tok_s_per_seq"] for r in runs if r["engine"] == e))
        runs = [r for r in runs if r["engine"] == best]
    return [v for r in runs for v in r["per_seq_tok_s"]]


def interval_table(data: dict, rows) -> list[str]:
    """SSD's speed ratios with 95 % paired-bootstrap intervals; a difference is called real only when the
    interval excludes 1."""
    pairs = [("saguaro-sync", "`sync`"), ("vllm-draft_model", "`draft_model`"), ("vllm-ar", "AR")]
    lines = []
    for (b, t) in rows:
        ssd = paired_speeds(data, "saguaro-async", b, t)
        for other, label in pairs:
            got = ratio_ci(ssd, paired_speeds(data, other, b, t))
            if got is None:
                continue
            r, lo, hi = got
            verdict = "SSD faster" if lo > 1 else ("SSD slower" if hi < 1 else "not distinguishable")
            lines.append(f"| {b} | {t:g} | SSD / {label} | {r:.2f}x | [{lo:.2f}, {hi:.2f}] | "
                         f"{min(len(ssd), len(paired_speeds(data, other, b, t)))} | {verdict} |")
    if not lines:
        return []
    return ["", "Speed ratios with 95 % intervals (paired bootstrap over requests: same prompt, seed and round "
            "in both engines):", "", "| batch | T | ratio | value | 95 % interval | requests | verdict |",
            "|---:|---:|---|---:|---|---:|---|", *lines]


def fmt(v, spec=".2f", dash="-"):
    return dash if v is None else format(v, spec)


def case_table(data: dict, rows) -> list[str]:
    lines = ["| batch | T | engine | tok/s per seq | total tok/s | vs AR | TTFT s | accept len | accept rate "
             "| hit rate | pre-draft / verify ms | peak MB |", "|" + "---:|" * 2 + "---|" + "---:|" * 9]
    for (b, t), engines in rows.items():
        ar = engines.get("vllm-ar", {}).get("decode_tok_s_per_seq")
        for fam in ORDER:
            f = engines.get(fam)
            if not f:
                continue
            name = LABEL[fam] + (f" K={f['engine'].rsplit('-k', 1)[1]}" if fam == "vllm-draft_model" else "")
            speed = f["decode_tok_s_per_seq"]
            pre = f"{fmt(f['predraft_ms'], '.0f')} / {fmt(f['verify_ms'], '.0f')}" if f["predraft_ms"] else "-"
            lines.append(f"| {b} | {t:g} | {name} | {fmt(speed)} | {fmt(f['total_tok_s'])} | "
                         f"{fmt(speed / ar, '.2f') + 'x' if ar and speed else '-'} | {fmt(f['ttft_s'])} | "
                         f"{fmt(f['mean_acceptance_length'])} | {fmt(f['acceptance_rate'])} | "
                         f"{fmt(f['hit_rate'], '.3f')} | {pre} | {fmt(f['peak_mb'], '.0f')} |")
    return lines


def bars(rows) -> list[str]:
    """The benchmark issue's bars, checked on this result (batch 1, T=0 unless stated)."""
    out = []
    b1t0 = rows.get((1, 0.0), {})
    ssd, dm, sync = (b1t0.get(k, {}).get("decode_tok_s_per_seq") for k in
                     ("saguaro-async", "vllm-draft_model", "saguaro-sync"))
    if ssd and dm:
        out.append(f"- SSD >= 1.5x vLLM `draft_model` (batch 1, T=0): {ssd / dm:.2f}x, "
                   f"{'met' if ssd / dm >= 1.5 else '**not met**'}")
    if ssd and sync:
        out.append(f"- SSD >= 1.3x Saguaro `sync` (batch 1, T=0): {ssd / sync:.2f}x, "
                   f"{'met' if ssd / sync >= 1.3 else '**not met**'}")
    for t, bar in ((0.0, 0.85), (1.0, 0.6)):
        hits = [e["saguaro-async"]["hit_rate"] for (b, tt), e in rows.items()
                if b == 1 and tt == t and e.get("saguaro-async", {}).get("hit_rate") is not None]
        if hits:
            out.append(f"- hit rate >= {bar} at T={t:g} (batch 1): {hits[0]:.3f}, "
                       f"{'met' if hits[0] >= bar else '**not met**'}")
    slower = [(b, t, e["saguaro-async"]["decode_tok_s_per_seq"] / e["saguaro-sync"]["decode_tok_s_per_seq"])
              for (b, t), e in rows.items() if "saguaro-async" in e and "saguaro-sync" in e
              and e["saguaro-sync"]["decode_tok_s_per_seq"]]
    if slower:
        worst = min(slower, key=lambda x: x[2])
        out.append(f"- SSD never slower than `sync` ({len(slower)} cases): worst {worst[2]:.3f}x at batch "
                   f"{worst[0]}, T={worst[1]:g}, {'met' if worst[2] >= 1.0 else '**not met**'}")
    return out


def plots(data: dict, rows) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    name = data["name"]
    temps = sorted({t for _, t in rows})
    batches = sorted({b for b, _ in rows})
    if len(batches) > 1:
        fig, axes = plt.subplots(1, len(temps), figsize=(4.5 * len(temps), 3.6), squeeze=False)
        for ax, t in zip(axes[0], temps):
            for fam in ORDER:
                pts = [(b, rows[(b, t)][fam]["decode_tok_s_per_seq"]) for b in batches
                       if (b, t) in rows and fam in rows[(b, t)]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=LABEL[fam].replace("`", ""))
            ax.set(title=f"T={t:g}", xlabel="batch size", ylabel="decode tok/s per sequence", xscale="log")
            ax.minorticks_off()
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(IMG / f"{name}-throughput.png", dpi=110)
        plt.close(fig)
        made.append((f"{name}-throughput.png", "decode tokens/s per sequence vs batch size"))
    # Speedup over AR per case.
    cases = [c for c in rows if "vllm-ar" in rows[c]]
    if cases:
        fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(cases) + 2), 3.6))
        width = 0.8 / 3
        for i, fam in enumerate(ORDER[1:]):
            xs = [j + (i - 1) * width for j, c in enumerate(cases) if fam in rows[c]]
            ys = [rows[c][fam]["decode_tok_s_per_seq"] / rows[c]["vllm-ar"]["decode_tok_s_per_seq"]
                  for c in cases if fam in rows[c]]
            ax.bar(xs, ys, width, label=LABEL[fam].replace("`", ""))
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(cases)), [f"b{b} T{t:g}" for b, t in cases], rotation=30)
        ax.set(ylabel="speedup over vLLM AR")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(IMG / f"{name}-speedup.png", dpi=110)
        plt.close(fig)
        made.append((f"{name}-speedup.png", "speedup over vLLM AR"))
    if len(temps) > 1:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        for b in batches:
            pts = [(t, rows[(b, t)]["saguaro-async"]) for t in temps if "saguaro-async" in rows.get((b, t), {})]
            if pts:
                ax.plot([t for t, _ in pts], [f["hit_rate"] for _, f in pts], marker="o", label=f"hit rate b{b}")
                ax.plot([t for t, _ in pts], [f["acceptance_rate"] for _, f in pts], marker="s", ls="--",
                        label=f"acceptance rate b{b}")
        ax.set(xlabel="temperature", ylabel="rate", ylim=(0, 1))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(IMG / f"{name}-temperature.png", dpi=110)
        plt.close(fig)
        made.append((f"{name}-temperature.png", "SSD hit rate and acceptance vs temperature"))
    return made


def sweep_section(data: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["results"] if r.get("sweep")]
    lines = ["| K | budget | C | T | tok/s per seq | accept len | accept rate | hit rate |", "|---:" * 8 + "|"]
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        s = r["sweep"]
        groups.setdefault((s["k"], s["budget"], s["scale"], r["temperature"], r["batch"]), []).append(r)
    pts = []
    for (k, budget, c, t, b), rs in sorted(groups.items(), key=lambda x: (x[0][0], str(x[0][1]), -x[0][2])):
        f = {key: mean(r.get(key) for r in rs) for key in
             ("decode_tok_s_per_seq", "mean_acceptance_length", "acceptance_rate", "hit_rate")}
        lines.append(f"| {k} | {budget} | {c:g} | {t:g} | {fmt(f['decode_tok_s_per_seq'])} | "
                     f"{fmt(f['mean_acceptance_length'])} | {fmt(f['acceptance_rate'])} | {fmt(f['hit_rate'], '.3f')} |")
        pts.append((c, f["acceptance_rate"], f["hit_rate"], k, budget))
    IMG.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for key in sorted({(k, str(bu)) for _, _, _, k, bu in pts}):
        sel = [(c, a, h) for c, a, h, k, bu in pts if (k, str(bu)) == key and a is not None and h is not None]
        if sel:
            ax.plot([a for _, a, _ in sel], [h for _, _, h in sel], marker="o", label=f"K={key[0]}, budget={key[1]}")
            for c, a, h in sel:
                ax.annotate(f"C={c:g}", (a, h), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="acceptance rate", ylabel="speculation-cache hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    img = f"{data['name']}-sweep.png"
    fig.savefig(IMG / img, dpi=110)
    plt.close(fig)
    return lines + ["", f"![acceptance vs hit rate as C varies](img/{img})"]


def load_latest_soak() -> dict | None:
    """The newest soak result (benchmarks/soak.py: `*-soak.json`, shaped differently from run.py's)."""
    found = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(RESULTS.glob("*-soak.json"))]
    found = [d for d in found if "summary" in d]
    return max(found, key=lambda d: d["date"]) if found else None


def soak_mix(st: dict) -> str:
    """The traffic beyond the base mix (benchmarks/soak.py's shares), in words; '' for a result without it."""
    parts = []
    if st.get("stream_share") is not None and st["stream_share"] < 1:
        parts.append(f"{100 * (1 - st['stream_share']):.0f} % of the requests not streamed")
    if st.get("cancel_share"):
        parts.append(f"{100 * st['cancel_share']:.0f} % of the streams closed by the client after 1-8 chunks")
    if st.get("n_share"):
        parts.append(f"{100 * st['n_share']:.0f} % of the sampled requests with n = 2 or 3")
    if st.get("long_share"):
        room = st.get("long_room_tokens") or []
        parts.append(f"{100 * st['long_share']:.0f} % of the prompts leaving "
                     + (f"{min(room)}-{max(room)} tokens" if room else "a few tokens")
                     + f" of max_model_len {st['max_model_len']}")
    return "; ".join(parts)


def fault_line(kill: dict) -> str:
    """One drafter fault of a soak and what it cost, from its result entry."""
    back, ready, gone = kill["recovered_after_s"], kill.get("ready_after_s"), kill.get("gone_after_s")
    sig = kill.get("signal", "SIGKILL")
    reasons = ", ".join(f"{r} {n:.0f}" for r, n in (kill.get("failures_by_reason") or {}).items())
    return (f"- drafter {sig} at {kill['at_s']:.0f} s with {kill.get('requests_in_flight', '?')} requests in "
            f"flight (their longest wait between two chunks: {fmt(kill.get('in_flight_max_chunk_gap_s'))} s); "
            + ("" if gone is None or sig == "SIGKILL" else f"the stopped process gone after {gone:.1f} s; ")
            + f"restarts counted on /metrics: {fmt(kill['restarts'], '.0f', dash='none (no such metric)')}, steps "
            f"without drafts counted as failures: {fmt(kill['failed_steps'], '.0f')}"
            + (f" ({reasons})" if reasons else "") + "; "
            + ("" if ready is not None and back is not None and abs(ready - back) < 0.05 else
               "new drafter ready after " + ("-" if ready is None else f"{ready:.1f} s") + ", ")
            + "drafts flowing again after "
            + ("**never**" if back is None else f"{back:.1f} s"))


def greedy_line(g: dict | None) -> list[str]:
    """The greedy replay's outcome (benchmarks/soak.py --compare-greedy); nothing for a result without one."""
    if not g:
        return []
    gap = g.get("least_top2_gap")
    return [f"- greedy outputs against plain vLLM ({g.get('plain_engine', 'no speculation')}): "
            f"{g['compared']} of {g['greedy_requests']} greedy requests compared token for token "
            f"({g['compared_as_prefix']} streams the client closed, as prefixes; {g['tokens_compared']} tokens; "
            f"{g['distinct_requests_replayed']} distinct requests replayed): **{g['mismatches']} mismatches** "
            f"(must be 0: {'met' if g['mismatches'] == 0 and g['compared'] == g['greedy_requests'] else '**not met**'})"
            + (f"; the least gap between the plain engine's top two logprobs over the compared tokens: {gap:.2g}"
               if gap is not None else "")]


def growth_misses(m: dict) -> str:
    """What fails a soak's growth criterion: the roles and drafters over 5 %, and the drafters not measured."""
    over = [f"{role} {100 * g:+.1f} %" for role, g in m["growth"].items() if role != "drafter" and g >= 0.05]
    over += [f"drafter {d['pid']} {100 * d['growth']:+.1f} %" for d in m.get("drafters") or []
             if d["growth"] is not None and d["growth"] >= 0.05]
    short = sum(d["growth"] is None for d in m.get("drafters") or [])
    return "; ".join(([", ".join(over)] if over else [])
                     + ([f"{short} drafter{'s' if short > 1 else ''} ran too short to be measured"] if short else []))


def fitted_change(p: dict) -> float | None:
    """A process's fitted RSS change over its measured span, relative to its first measured sample (None where
    no trend was fitted: too few samples, or a drafter not measured)."""
    if p.get("trend_mb_per_h") is None or not p.get("start_mb") or p.get("growth") is None:
        return None
    return p["trend_mb_per_h"] * (p["to_t_s"] - p["from_t_s"]) / 3600 / p["start_mb"]


def replacement_line(r: dict) -> str:
    """A drafter the plugin replaced on its own during a soak (benchmarks/soak.py `unexpected_replacements`): its
    log line's reason and what /proc said of it over its last sampled second and a half."""
    reason = (r.get("log") or "").split("Saguaro: ", 1)[-1].split("; restarting", 1)[0].split("; gave up", 1)[0]
    hist = r.get("last_samples") or []
    evidence = ""
    if hist:
        end = hist[-1][0]
        window = [h for h in hist if h[0] >= end - 1.5]
        states = "".join(sorted({h[1] for h in window}))
        cpu = window[-1][2] - window[0][2]
        run = [h[3] for h in window if h[3] is not None]
        evidence = (f"; /proc over its last {end - window[0][0]:.1f} s: state {states}, {cpu:.2f} CPU-seconds"
                    + (f", {min(run)}-{max(run)} runnable tasks on the machine" if run else ""))
    return f"  - pid {r['pid']}, last seen at {r['last_seen_s']:.0f} s: {reason or 'no log line'}{evidence}"


def soak_companions(data: dict) -> list[dict]:
    """Other soak results of the same day (`<date>-soak-<label>.json`: a reference or an earlier run)."""
    day = data["_file"][:10]
    out = []
    for path in sorted(RESULTS.glob(f"{day}-soak-*.json")):
        d = json.loads(path.read_text())
        if "summary" in d and path.name != data["_file"]:
            out.append(d | {"_file": path.name})
    return out


def companion_line(d: dict) -> str:
    """One line on another soak result of the day."""
    s, m, sp = d["summary"], d["memory"], d["speculation"]
    g = d.get("greedy_check")
    worker = m["growth"].get("worker")
    plain = d["settings"].get("mode") == "plain"
    disabled = d.get("speculation_disabled_at_s")
    if disabled is None:  # results written before that field: from the client states polled each second
        disabled = next((p["t"] for p in d.get("timeline") or [] if p.get("state") == "disabled"), None)
    return (f"- `{d['_file']}`"
            + ("" if plain else f" (Saguaro `{json.dumps(d['settings'].get('saguaro') or {'mode': 'async'})}`)")
            + f": {s['requests']} requests over "
            f"{d['settings']['duration_s']:g} s, {d['errors']} errors"
            + (f", {g['mismatches']} greedy mismatches in {g['compared']}" if g else "")
            + ("" if plain else f", hit rate {fmt(sp.get('cache_hit_rate'), '.3f')}")
            + (f", speculation disabled at {disabled:.0f} s (restart budget spent)" if disabled is not None else "")
            + ("; no speculative config: vLLM alone under the same traffic" if plain else "")
            + (f"; worker RSS {m['start_mb']['worker']:.0f} -> {m['end_mb']['worker']:.0f} MB "
               f"({100 * worker:+.1f} %, {fmt((m.get('trend_mb_per_h') or {}).get('worker'), '+.0f')} MB/h) from "
               f"{m['start_t_s']:.0f} s to {m['end_t_s']:.0f} s" if worker is not None else ""))


def soak_plot_link(data: dict) -> list[str]:
    """The soak's plot (written beside its result by benchmarks/soak.py), where it exists."""
    name = data.get("plot")
    if not name or not (RESULTS / name).exists():
        return []
    return ["", f"![memory per process, hit rate and tokens/s over time, drafter faults](../benchmarks/results/{name})"]


def soak_section(data: dict) -> list[str]:
    """Figures of benchmarks/soak.py: traffic, errors, the drafter faults, greedy equality, hit rate, memory per
    process, the dashboard's metrics, other load."""
    s, st, m, load = data["summary"], data["settings"], data["memory"], data["load"]
    kills = data.get("kills") or ([data["kill"]] if data.get("kill") else [])  # "kill": results before 12-04
    ms = lambda f: fmt(None if f is None else 1e3 * f, ".1f")  # noqa: E731
    mix = soak_mix(st)
    out = ["## Soak", "",
           f"- command: `{data['command']}` (result {result_link(data['_file'])})",
           f"- {st['clients']} concurrent clients for {st['duration_s']:g} s against `vllm serve` on "
           f"127.0.0.1, Saguaro `{json.dumps(st.get('saguaro') or {'mode': 'async'})}`, K={st['k']}; models: "
           f"{data['models']}; temperatures {list(st['temperatures'])} (drawn per request"
           + (f": {100 * st['greedy_share']:.0f} % greedy" if st.get("greedy_share") is not None else "")
           + f"), max_tokens {list(st['lengths'])}, stop "
           "by length (ignore_eos), EOS, stop strings or stop token ids; a quarter of the requests are chats"
           + (f"; {mix}" if mix else ""),
           f"- machine: {data['machine']['cpu']}, {data['machine']['cpus']} cores; load average "
           f"{load['loadavg_before'][0]:.1f} before, "
           + (f"{load['loadavg_1min_during']['mean']:.1f} on average during the run (max "
              f"{load['loadavg_1min_during']['max']:.1f}), " if load.get("loadavg_1min_during") else "")
           + f"{load['loadavg_after'][0]:.1f} after",
           "", "| requests | errors | tokens/s | latency p50 / p99 s | TTFT p50 / p99 s | TPOT p50 / p99 ms |",
           "|---:|---:|---:|---:|---:|---:|",
           f"| {s['requests']} | {data['errors']} | {fmt(s['tokens_per_s'], '.1f')} | "
           f"{fmt(s['latency_s']['p50'])} / {fmt(s['latency_s']['p99'])} | {fmt(s['ttft_s']['p50'])} / "
           f"{fmt(s['ttft_s']['p99'])} | {ms(s['tpot_s']['p50'])} / {ms(s['tpot_s']['p99'])} |", ""]
    if "streamed_requests" in s:
        out += ["| greedy | sampled | streamed | not streamed | closed mid-stream | n > 1 (choices in all) | "
                "near max_model_len | chats |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
                f"| {s['greedy_requests']} | {s['sampled_requests']} | {s['streamed_requests']} | "
                f"{s['non_streamed_requests']} | {s['cancelled_requests']} | {s['n_gt_1_requests']} ({s['choices']}) | "
                f"{s['long_prompt_requests']} | {s['chat_requests']} |", ""]
    gap = s.get("max_chunk_gap_s")
    if gap:
        out += [f"- longest wait between two chunks of one stream: p50 {fmt(gap['p50'])} s, p99 {fmt(gap['p99'])} s, "
                f"max {fmt(gap['max'])} s"]
    out += [fault_line(kill) for kill in kills]
    extra = data.get("unexpected_replacements")
    if extra is not None:
        out += [f"- drafters the plugin replaced on its own (no scheduled fault): {len(extra)}"
                + (" (the plugin's reason and the process's last /proc samples):" if extra else "")]
        out += [replacement_line(r) for r in extra]
    if data.get("speculation_disabled_at_s") is not None:
        out += [f"- speculation **disabled** at {data['speculation_disabled_at_s']:.0f} s (the restart budget, "
                f"`saguaro.max_restarts` {st.get('saguaro', {}).get('max_restarts', 5)}, spent)"]
    if data.get("server_log_tracebacks_before_stop") is not None:
        out += [f"- tracebacks in the server log before its stop: {data['server_log_tracebacks_before_stop']}"]
    out += greedy_line(data.get("greedy_check"))
    sp = data["speculation"]
    hw = sp.get("hit_rate_windows") or {}
    labelled = (("before the first fault", hw.get("before_kill")),
                ("after the last replacement's drafts flowed", hw.get("after_recovery")))
    windows = [f"{label} {fmt(w['hit_rate'], '.3f')} ({w['from_t_s']:.0f}-{w['to_t_s']:.0f} s, {w['lookups']:.0f} "
               "lookups)" for label, w in labelled if w]
    between = [f"{fmt(w['hit_rate'], '.3f')} after the {w['after']}" for w in hw.get("between_faults") or [] if w]
    out += [f"- speculation over the run: acceptance rate {fmt(sp['acceptance_rate'])}, mean acceptance length "
            f"{fmt(sp['mean_acceptance_length'])}, speculation-cache hit rate {fmt(sp['cache_hit_rate'], '.3f')}"
            + (f"; {', '.join(windows)}" if windows else "")
            + (f"; from each recovery to the next fault: {', '.join(between)}" if len(between) > 1 else "")
            + (f"; rounds that pre-drafted: {100 * sp['predraft_share']:.0f} % (the rest drafted as `sync` does)"
               if sp.get("predraft_share") is not None else "")
            + (f", {100 * sp['branch_steps_skipped_share']:.0f} % of them without their branch steps (their expected "
               "saving below the lateness they cause: `predraft_skipped_total`)"
               if sp.get("branch_steps_skipped_share") is not None else ""),
            f"- errors must be 0: {'met' if data['errors'] == 0 else '**not met**'}; resident memory growth < 5 % "
            f"(first to last measured sample) for every process: {'met' if m['ok'] else '**not met**'}"
            + ("" if m["ok"] else f" ({growth_misses(m)})"), "",
            "| process | measured from - to s | RSS MB at start | RSS MB at end | growth | trend MB/h |",
            "|---|---:|---:|---:|---:|---:|"]
    drafters = m.get("drafters")
    trend = m.get("trend_mb_per_h") or {}
    for role, start in m["start_mb"].items():
        if role == "drafter" and drafters is not None:
            continue  # one row per drafter process below
        g = m["growth"].get(role)
        out.append(f"| {role} | {fmt(m['start_t_s'], '.0f')} - {fmt(m['end_t_s'], '.0f')} | {start:.0f} | "
                   f"{fmt(m['end_mb'].get(role), '.0f')} | {'-' if g is None else f'{100 * g:+.1f} %'} | "
                   f"{fmt(trend.get(role), '+.1f')} |")
    for d in drafters or []:
        span = ("not measured (ran too short)" if d["from_t_s"] is None
                else f"{d['from_t_s']:.0f} - {d['to_t_s']:.0f}")
        g = d["growth"]
        out.append(f"| drafter, {d['which']} (pid {d['pid']}) | {span} | {fmt(d['start_mb'], '.1f')} | "
                   f"{fmt(d['end_mb'], '.1f')} | {'-' if g is None else f'{100 * g:+.1f} %'} | "
                   f"{fmt(d.get('trend_mb_per_h'), '+.1f')} |")
    procs = m.get("processes")
    if procs:
        fitted = {pid: fitted_change(p) for pid, p in procs.items()}
        over = [f"{procs[pid]['role']} {pid} ({100 * f:+.1f} %)" for pid, f in fitted.items()
                if f is not None and abs(f) >= 0.05]
        out += ["", f"- fitted change (the least-squares trend over each process's measured span, which a transient "
                "peak in the last sample does not move; per process in the result file) under 5 % for every process measured "
                f"({sum(f is not None for f in fitted.values())} of {len(fitted)}): "
                + ("met" if not over else "**not met**: " + ", ".join(over))]
    jumps = m.get("kill_jumps") or []
    if jumps:
        out += [""] + [f"- memory across the fault at {j['at_s']:.0f} s (sample at {j['from_t_s']:.0f} s to "
                       f"{j['to_t_s']:.0f} s): " + ", ".join(f"{role} {mb:+.0f} MB" for role, mb in j["mb"].items())
                       for j in jumps]
    out += soak_dashboard_lines(data.get("dashboard"))
    out += soak_plot_link(data)
    companions = soak_companions(data)
    if companions:
        out += ["", "Other soak runs of the day:", ""] + [companion_line(d) for d in companions]
    others = load.get("other_cpu_s_total") or 0.0
    others_cores = others / max(data["traffic_s"] + data["drain_s"], 1)
    out += ["", f"Growth is measured from the first sample {fmt(st.get('warmup_s'), '.0f')} s into the run "
            "(why the worker climbs: [dev/troubleshooting.md](dev/troubleshooting.md#memory)). "
            + ("Each drafter is measured over its own life, a replacement from "
               f"{fmt(st.get('drafter_settle_s'), '.0f')} s after it was ready. " if drafters is not None else
               "The drafter row compares the first drafter (start) with the last replacement (end). ")
            + (f"Other processes used {others:.0f} CPU-seconds of the {data['machine']['cpus']} cores during "
               f"the run (about {others_cores:.2f} cores on average): "
               + ("the figures are from a shared machine." if others_cores >= SHARED_CORES else
                  "the machine was otherwise idle.")), ""]
    return out


#: Cores other processes used on average during a soak from which its page calls the machine shared.
SHARED_CORES = 0.05
#: Dashboard counters a soak's section names (docs/metrics.md), by their sample name's start.
SOAK_COUNTERS = ("vllm:saguaro_drafter_restarts_total", "vllm:saguaro_drafter_failures_total",
                 "vllm:saguaro_rounds_total", "vllm:saguaro_backups_total", "vllm:saguaro_rows_undrafted_total",
                 "vllm:saguaro_predraft_skipped_total", "vllm:saguaro_predraft_cut_short_total",
                 "vllm:saguaro_rows_no_room_total", "vllm:saguaro_branches_dropped_total",
                 "vllm:saguaro_sampled_rows_capped_total")


def soak_dashboard_lines(dash: dict | None) -> list[str]:
    """What the dashboard's metrics (sampled every ~10 s during the soak) ended at, and its gauges' range."""
    if not dash or not dash.get("summary"):
        return []
    sm = dash["summary"]
    counters = sm.get("counters") or {}
    named = []
    for name in SOAK_COUNTERS:
        got = {k: v for k, v in counters.items() if k.split("{", 1)[0] == name and v}
        if got:
            named.append(", ".join(f"`{k.removeprefix('vllm:saguaro_')}` {v:.0f}" for k, v in sorted(got.items())))
    gauges = sm.get("gauges") or {}
    shown = [f"`{k.removeprefix('vllm:saguaro_')}` {g['min']:g}-{g['max']:g} (after the drain {g['after_drain']:g})"
             for k, g in sorted(gauges.items()) if k.startswith("vllm:saguaro_drafter_requests")]
    last = dash["samples"][-1]["samples"] if dash.get("samples") else {}
    prefix = 'vllm:saguaro_drafter_state{state="'
    state = next((k[len(prefix):].split('"', 1)[0] for k, v in last.items() if k.startswith(prefix) and v == 1), None)
    return ["", f"- the dashboard's metrics (`/metrics`, sampled every {dash['every_s']:g} s, {sm['samples']} samples "
            "in the result): at the end " + ("; ".join(named) or "no Saguaro counter moved")
            + (f"; gauges over the run: {'; '.join(shown)}" if shown else "")
            + (f"; the drafter client's state after the drain: `{state}`" if state else "")
            + (" (the drafter's gauges keep the last drafter's values until a new one reports)"
               if state in ("restarting", "disabled") else "")]


TROUBLESHOOTING = ROOT / "docs" / "dev" / "troubleshooting.md"


def _from_dev(line: str) -> str:
    """A docs/ line's links as seen from docs/dev/ (where the generated soak blocks live)."""
    return line.replace("](benchmarks.md", "](../benchmarks.md").replace("](../benchmarks/results/",
                                                                         "](../../benchmarks/results/")
SOAK_BEGIN = ("<!-- soak:begin (generated by benchmarks/report.py from the newest benchmarks/results/*-soak.json; "
              "edits here are overwritten) -->")
SOAK_END = "<!-- soak:end -->"
ROLE_NAMES = {"server": "API server", "engine core": "engine core", "worker": "worker", "other": "other"}


def soak_memory_block(data: dict) -> list[str]:
    """The soak's memory figures for docs/dev/troubleshooting.md (Memory), from the result the benchmarks page shows:
    written between SOAK_BEGIN and SOAK_END by `sync_troubleshooting`, so the page cannot drift from the data."""
    st, m, sp = data["settings"], data["memory"], data["speculation"]
    kills = data.get("kills") or ([data["kill"]] if data.get("kill") else [])
    pct = lambda g: "-" if g is None else f"{100 * g:+.1f} %"  # noqa: E731
    greedy = f", {100 * st['greedy_share']:.0f} % greedy" if st.get("greedy_share") is not None else ""
    kill_text = "; ".join(f"drafter {k.get('signal', 'SIGKILL')} at {k['at_s']:.0f} s, drafts flowing again after "
                          + ("never" if k["recovered_after_s"] is None else f"{k['recovered_after_s']:.1f} s")
                          for k in kills) or "no drafter kill"
    roles = [f"{ROLE_NAMES.get(role, role)} {pct(m['growth'].get(role))} ({start:.0f} -> "
             f"{fmt(m['end_mb'].get(role), '.0f')} MB)" for role, start in m["start_mb"].items() if role != "drafter"]
    drafters = []
    for d in m.get("drafters") or []:
        if d["growth"] is None:
            drafters.append(f"{d['which']} (pid {d['pid']}) not measured (alive {d['alive_t_s'][0]:.0f}-"
                            f"{d['alive_t_s'][1]:.0f} s, too short after its settle time)")
        else:
            drafters.append(f"{d['which']} (pid {d['pid']}) {pct(d['growth'])} ({d['start_mb']:.1f} -> "
                            f"{d['end_mb']:.1f} MB, {d['from_t_s']:.0f}-{d['to_t_s']:.0f} s)")
    if not m.get("drafters"):
        drafters.append("not measured per process in this result (" + (m.get("notes", {}).get("drafter")
                                                                       or "no note") + ")")
    jumps = "; ".join(f"across the fault at {j['at_s']:.0f} s: " + ", ".join(
        f"{ROLE_NAMES.get(role, role)} {mb:+.0f} MB" for role, mb in j["mb"].items() if role != "other")
        for j in m.get("kill_jumps") or [])
    return [SOAK_BEGIN, _from_dev(
            f"- **In the soak** ([benchmarks.md](benchmarks.md#soak), "
            f"{result_link(data['_file'])}: {st['clients']} clients for {st['duration_s']:g} s{greedy}, "
            f"models: {data['models']}; speculation-cache hit rate {fmt(sp.get('cache_hit_rate'), '.3f')}; "
            + (f"1-minute load average {data['load']['loadavg_1min_during']['mean']:.1f} on "
               f"{data['machine']['cpus']} cores during the run; " if data["load"].get("loadavg_1min_during") else "")
            + f"{kill_text}): resident memory growth from the sample {fmt(m['start_t_s'], '.0f')} s into the run to "
            f"the end ({fmt(m['end_t_s'], '.0f')} s): " + ", ".join(roles) + "; the drafters, each over its own "
            "life: " + "; ".join(drafters) + "." + (f" Memory {jumps}." if jumps else "")
            + f" Growth under 5 % for every process: {'met' if m['ok'] else 'not met'}."
            + (" Fitted change over the measured span (the least-squares trend, which a transient peak in the last "
               "sample does not move): " + ", ".join(
                   f"{p['role']} {pid} {100 * fitted_change(p):+.1f} %" for pid, p in m["processes"].items()
                   if fitted_change(p) is not None and p["role"] != "other") + "." if m.get("processes") else "")
            + (f" Fitted trends (MB per hour over the measured span): " + ", ".join(
                f"{ROLE_NAMES.get(role, role)} {v:+.1f}" for role, v in (m.get("trend_mb_per_h") or {}).items()
                if v is not None and role != "other") + "." if m.get("trend_mb_per_h") else "")
            + (f" Plot: [{data['plot']}](../benchmarks/results/{data['plot']})." if soak_plot_link(data) else "")),
            SOAK_END]


SOAK_FAULTS_BEGIN = ("<!-- soak-faults:begin (generated by benchmarks/report.py from the newest "
                     "benchmarks/results/*-soak.json; edits here are overwritten) -->")
SOAK_FAULTS_END = "<!-- soak-faults:end -->"


def soak_faults_block(data: dict) -> list[str]:
    """What the soak's drafter faults cost and what held through them, for docs/dev/troubleshooting.md (When the
    drafter fails); written between SOAK_FAULTS_BEGIN and SOAK_FAULTS_END by `sync_troubleshooting`."""
    st, s, sp = data["settings"], data["summary"], data["speculation"]
    kills = data.get("kills") or ([data["kill"]] if data.get("kill") else [])
    by_sig: dict[str, list[dict]] = {}
    for k in kills:
        by_sig.setdefault(k.get("signal", "SIGKILL"), []).append(k)
    def span(xs: list[float]) -> str:
        return "-" if not xs else f"{min(xs):.1f}" if min(xs) == max(xs) else f"{min(xs):.1f}-{max(xs):.1f}"

    parts = []
    for sig, ks in sorted(by_sig.items()):
        back = [k["recovered_after_s"] for k in ks if k["recovered_after_s"] is not None]
        gaps = [k["in_flight_max_chunk_gap_s"] for k in ks if k.get("in_flight_max_chunk_gap_s") is not None]
        text = (f"{len(ks)} {sig}{'s' if len(ks) > 1 else ''} (at " + ", ".join(f"{k['at_s']:.0f}" for k in ks)
                + " s): drafts flowing again after " + span(back) + " s"
                + ("" if len(back) == len(ks) else f" ({len(ks) - len(back)} never)"))
        if sig == "SIGSTOP":
            gone = [k["gone_after_s"] for k in ks if k.get("gone_after_s") is not None]
            text += f", the stopped process killed by the plugin within {span(gone)} s"
        text += f", longest wait between two chunks of a stream in flight {span(gaps)} s"
        parts.append(text)
    mix = soak_mix(st)
    g = data.get("greedy_check")
    extra = data.get("unexpected_replacements")
    if extra:
        parts.append(f"{len(extra)} drafter{'s' if len(extra) > 1 else ''} replaced by the plugin on its own "
                     "(no scheduled fault; [benchmarks.md](benchmarks.md#soak) lists why)")
    if data.get("speculation_disabled_at_s") is not None:
        parts.append(f"speculation disabled at {data['speculation_disabled_at_s']:.0f} s (restart budget spent)")
    held = [f"failed requests {data['errors']}"]
    if g:
        held.append(f"greedy outputs equal to plain vLLM's token for token in {g['compared'] - g['mismatches']} of "
                    f"{g['compared']} compared requests ({g['mismatches']} mismatches)")
    held.append(f"speculation-cache hit rate over the run {fmt(sp.get('cache_hit_rate'), '.3f')}"
                + (f" ({100 * sp['predraft_share']:.0f} % of the rounds pre-drafted)"
                   if sp.get("predraft_share") is not None else ""))
    return [SOAK_FAULTS_BEGIN, _from_dev(
            f"- **In the soak** ([benchmarks.md](benchmarks.md#soak), `benchmarks/results/{data['_file']}`: "
            f"{st['clients']} clients through `vllm serve` for {st['duration_s']:g} s, {s['requests']} requests, "
            f"temperatures {list(st['temperatures'])}" + (f"; {mix}" if mix else "") + f"; models: {data['models']}): "
            + ("; ".join(parts) or "no drafter fault") + ". Through them: " + ", ".join(held) + "."),
            SOAK_FAULTS_END]


def sync_troubleshooting(data: dict, path: Path = TROUBLESHOOTING) -> bool:
    """Rewrite the generated soak blocks of docs/dev/troubleshooting.md (memory; the faults, where its markers are);
    False (page untouched) without the memory block's markers."""
    text = path.read_text()
    if SOAK_BEGIN not in text or SOAK_END not in text:
        return False
    for begin, end, block in ((SOAK_BEGIN, SOAK_END, soak_memory_block),
                              (SOAK_FAULTS_BEGIN, SOAK_FAULTS_END, soak_faults_block)):
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + "\n".join(block(data)) + tail
    path.write_text(text)
    return True


def load_serve() -> dict | None:
    """The newest result of `benchmarks/bench_serve.py` (`*-serve-<label>.json`; labels `smoke*` skipped)."""
    found = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(RESULTS.glob("*-serve-*.json"))]
    found = [d for d in found if d.get("kind") == "serve" and not d.get("label", "").startswith("smoke")]
    return max(found, key=lambda d: d["date"]) if found else None


SERVE_DATASETS = {"random": "`random` ({random_input_len} random prompt tokens)",
                  "corpus": "`corpus` ({corpus_prompts} held-out demo-corpus snippets, vLLM's `custom` JSONL)"}


def _serve_cells(data: dict) -> list[tuple[str, float, int, dict]]:
    """(dataset, temperature, concurrency, {engine: row}) in the order of the table."""
    cells: dict[tuple, dict] = {}
    for r in data["runs"]:
        cells.setdefault((r["dataset"], r["temperature"], r["concurrency"]), {})[r["engine"]] = {
            **r["row"], "load": (r.get("load_avg_1m") or [None])[0]}
    return [(d, t, c, rows) for (d, t, c), rows in sorted(cells.items())]


def serve_section(data: dict) -> list[str]:
    """`vllm bench serve` figures per dataset, temperature, concurrency and engine, and the TPOT plot."""
    m, st = data["machine"], data["settings"]
    out = ["## Serving", "", "Every engine as a `vllm serve` driven by vLLM's own `vllm bench serve`.", "",
           f"`benchmarks/bench_serve.py` ({result_link(data['_file'])}; vLLM's own result JSON of every run in "
           f"`{data['result_dir']}/`): each engine a `vllm serve` of `{model_dir(data['target'])}` "
           f"(draft `{model_dir(data['draft'])}`), "
           f"driven by vLLM's benchmark client at max concurrency {', '.join(map(str, st['concurrency']))} "
           f"(requests per run: {', '.join(f'{n} at {c}' for c, n in st['requests'].items())}; all sent at once), "
           f"{st['output_len']} output tokens per request (ignore_eos), K={st['k']}, client `{st.get('client', 'cli')}`. "
           f"Datasets: " + "; ".join(SERVE_DATASETS[d].format(**st) for d in st["datasets"]) + ". "
           f"Placement `{data['placement']['mode']}` ({placement_rule(data['placement'])}). Machine: "
           f"{m['cpu']}, {m['cpus']} cores; load average {data['load_avg']['start'][0]:.1f} at the start, "
           f"{data['load_avg']['end'][0]:.1f} at the end. {data.get('note') or ''}", "",
           f"- command: `{short_command(data['command'], data.get('note'))}` ({data['runtime_s'] / 60:.0f} min)",
           *(f"- added later ({e['date'][:16].replace('T', ' ')} UTC, load average {e['load_avg']['start'][0]:.1f} at "
             f"its start, cases {', '.join(e['cases'])}): `{e['command']}` ({e['runtime_s'] / 60:.0f} min). "
             f"{e.get('note') or ''}".rstrip() for e in data.get("extended", [])),
           "- TTFT and TPOT (per request, excluding the first token) in ms, p50 / p99 (vLLM's result JSON also "
           "holds ITL, between streamed chunks); output tok/s over the run; acceptance from the server's "
           "spec-decode counters; hit rate: SSD's speculation cache, from `/metrics`; load: the machine's 1-minute "
           "load average when the run started (other jobs included).", "",
           "| dataset | T | concurrency | engine | TTFT ms | TPOT ms | output tok/s | vs AR | accept rate "
           "| accept len | hit rate | load |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pair(row, metric):
        return f"{fmt(row.get(f'p50_{metric}_ms'), '.0f')} / {fmt(row.get(f'p99_{metric}_ms'), '.0f')}"

    for dataset, t, c, rows in _serve_cells(data):
        ar = (rows.get("vllm-ar") or {}).get("output_throughput")
        for fam in ORDER:
            row = rows.get(fam)
            if row is None:
                continue
            tput = row.get("output_throughput")
            out.append(f"| {dataset} | {t:g} | {c} | {LABEL[fam]} | {pair(row, 'ttft')} | {pair(row, 'tpot')} "
                       f"| {fmt(tput, '.1f')} | "
                       f"{fmt(tput / ar if ar and tput else None, '.2f')}{'x' if ar and tput else ''} "
                       f"| {fmt(row.get('spec_decode_acceptance_rate'))} | {fmt(row.get('spec_decode_acceptance_length'))} "
                       f"| {fmt(row.get('hit_rate'), '.3f')} | {fmt(row.get('load'), '.1f')} |")
    failed = sum((r["row"].get("failed") or 0) for r in data["runs"])
    out += ["", f"Failed requests: {failed} of {sum(r['num_prompts'] for r in data['runs'])}.", ""]
    img = serve_plot(data)
    return out + [f"![TPOT against concurrency](img/{img})", ""]


def serve_plot(data: dict) -> str:
    """TPOT p50 (solid) and p99 (dashed) against concurrency, one panel per dataset and temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = _serve_cells(data)
    panels = sorted({(d, t) for d, t, _, _ in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (dataset, t) in zip(axes[0], panels):
        conc = sorted({c for d, tt, c, _ in cells if (d, tt) == (dataset, t)})
        for i, fam in enumerate(ORDER):
            pts = [(c, rows[fam]) for d, tt, c, rows in cells if (d, tt) == (dataset, t) and fam in rows]
            if not pts:
                continue
            color = f"C{i}"
            ax.plot([c for c, _ in pts], [r.get("p50_tpot_ms") for _, r in pts], marker="o", color=color,
                    label=LABEL[fam].replace("`", ""))
            ax.plot([c for c, _ in pts], [r.get("p99_tpot_ms") for _, r in pts], ls="--", lw=0.8, color=color)
        ax.set(title=f"{dataset}, T={t:g}", xlabel="concurrency", ylabel="TPOT ms (p50; p99 dashed)", xscale="log",
               yscale="log")
        ax.minorticks_off()
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    img = f"{data['name']}-tpot.png"
    fig.savefig(IMG / img, dpi=110)
    plt.close(fig)
    return img


def load_transport() -> dict | None:
    """The newest result of `benchmarks/bench_transport.py` whose Saguaro runs carry code-tree names."""
    return _newest_transport(lambda data: any(r.get("tree") for r in data["results"]))


def _newest_transport(wanted) -> dict | None:
    """The newest `bench_transport.py` result for which `wanted(data)` holds (its file name in `_file`)."""
    found = []
    for path in sorted(RESULTS.glob("*-transport-*.json")):
        data = json.loads(path.read_text())
        if data.get("kind") == "transport" and wanted(data):
            data["_file"] = path.name
            found.append(data)
    return max(found, key=lambda d: d["date"]) if found else None


def _transport_header(data: dict, title: str) -> list[str]:
    """A `bench_transport.py` section's title, what ran where, and the command."""
    m = data["machine"]
    return [f"## {title}", "",
            f"`benchmarks/bench_transport.py` ({result_link(data['_file'])}, {data['date'][:16]} UTC, "
            f"commit {data['commit']}): "
            f"{data['model']}, K={data['k']}, {data['max_tokens']} output tokens per request, prompts of "
            f"{data['prompt_len']} tokens; {data['placement']}. Machine: {m['cpu']}, {m['cpus']} cores. "
            f"{data.get('note') or ''}", "",
            f"- command: `{short_command(data['command'], data.get('note'))}`"]


def transport_section(data: dict) -> list[str]:
    """Per vocabulary and batch: what T = 1 adds per step over T = 0 for vLLM `draft_model` and Saguaro
    `sync` (each code tree), and the proposer-side part of it (the bar of issue 16: <= 3 ms at batch 16)."""
    out = _transport_header(data, "Sampled-path transport (issue 16 item 5)") + [
           "- step: generate wall time / engine steps; propose: the proposer's `propose`; ours: `propose` minus "
           "the drafter's own compute (wall clock: transport and proposer-side work, plus waits for a core on a "
           "busy machine) / the CPU time of the proposer's thread in `propose` (message, receive, checks, "
           "probability assembly; the figure of the 3 ms bar); "
           "drafter: the drafter's compute per step (incl. making q and sampling); vLLM: its gather of the "
           "draft probabilities plus the rejection sampler. Load: 1-minute load average at the T=1 job's start "
           "(other jobs shared the machine).", "",
           "| vocab | batch | engine | step ms T=0 | step ms T=1 | T=1 adds ms | propose ms T=1 | ours ms T=1 "
           "(wall / CPU) "
           "| drafter ms T=0 / T=1 | vLLM gather + reject ms T=1 | accept rate T=1 | load |",
           "|---:|---:|---|" + "---:|" * 9]
    cells: dict[tuple, dict] = {}
    for r in data["results"]:
        name = "vLLM `draft_model`" if r["engine"] == "vllm-draft_model" else f"Saguaro `sync` ({r.get('tree')})"
        cells.setdefault((r["vocab"], r["batch"], name), {})[r["temperature"]] = r
    checks = []
    for (vocab, batch, name), by_t in sorted(cells.items()):
        t0, t1 = by_t.get(0.0), by_t.get(1.0)
        if t0 is None or t1 is None:
            continue
        added = t1["step_ms"] - t0["step_ms"]
        by_t["added"] = added
        vllm_ms = (t1.get("gather_ms") or 0) + (t1.get("rejection_ms") or 0)
        drafter = f"{fmt(t0.get('drafter_ms'), '.1f')} / {fmt(t1.get('drafter_ms'), '.1f')}"
        out.append(f"| {vocab} | {batch} | {name} | {t0['step_ms']:.1f} | {t1['step_ms']:.1f} | {added:+.1f} "
                   f"| {fmt(t1.get('propose_ms'), '.1f')} | {fmt(t1.get('ours_ms'), '.1f')} / "
                   f"{fmt(t1.get('propose_cpu_ms'), '.2f')} | {drafter} "
                   f"| {vllm_ms:.1f} | {fmt(t1.get('acceptance_rate'), '.2f')} | {fmt((t1.get('load_avg_1m') or [None])[0], '.1f')} |")
    for (vocab, batch, name), by_t in sorted(cells.items()):
        ref = cells.get((vocab, batch, "vLLM `draft_model`"), {})
        if not name.startswith("Saguaro") or "added" not in by_t or "added" not in ref:
            continue
        ours = by_t[1.0].get("propose_cpu_ms")
        line = (f"- vocab {vocab}, batch {batch}, {name}: T=1 adds {by_t['added']:+.1f} ms per step against "
                f"{ref['added']:+.1f} ms for `draft_model` ({'met' if by_t['added'] <= ref['added'] else 'missed'})")
        if batch == 16 and ours is not None:
            line += f"; proposer side {ours:.2f} ms CPU ({'met' if ours <= 3.0 else 'missed'}: bar 3 ms)"
        checks.append(line)
    if checks:
        out += ["", "Bars of issue 16 item 5 on this result:", ""] + checks
    return out + [""]


def load_real_vocab() -> dict | None:
    """The newest `bench_transport.py` result that ran every engine side by side (AR, `draft_model`,
    Saguaro `sync` and `async`): the real-vocabulary comparison of issue 26."""
    return _newest_transport(
        lambda data: {"vllm-ar", "saguaro-async", "vllm-draft_model"} <= {r["engine"] for r in data["results"]})


REAL_VOCAB_ENGINES = (("vllm-ar", "vLLM AR"), ("vllm-draft_model", "vLLM `draft_model`"),
                      ("saguaro-sync", "Saguaro `sync`"), ("saguaro-async", "Saguaro `async`"))


def real_vocab_section(data: dict) -> list[str]:
    """Per vocabulary, batch and temperature: milliseconds per engine step of every engine, Saguaro's against
    `draft_model` (the bar: no more per step), and the proposal ring's memory."""
    out = _transport_header(data, "Real vocabularies") + [
           "- every draft is accepted (draft == target), so the per-step difference is each path's own cost; "
           "ms per step = generate wall time / engine steps (AR: one token per step, the others K+1).",
           "- bar (issue 26): Saguaro `async` and `sync` cost no more per step than vLLM `draft_model` at "
           "batch 16 and 64, T=0 and T=1.", "",
           "| vocab | batch | T | " + " | ".join(f"{name} ms/step" for _, name in REAL_VOCAB_ENGINES)
           + " | `sync` / `draft_model` | `async` / `draft_model` | `async` hit rate | ring MB used |",
           "|---:|---:|---:|" + "---:|" * (len(REAL_VOCAB_ENGINES) + 4)]
    cells: dict[tuple, dict] = {}
    for r in data["results"]:
        cells.setdefault((r["vocab"], r["batch"], r["temperature"]), {})[r["engine"]] = r
    checks = []
    for (vocab, batch, t), by_engine in sorted(cells.items()):
        step = {e: (by_engine.get(e) or {}).get("step_ms") for e, _ in REAL_VOCAB_ENGINES}
        ref = step.get("vllm-draft_model")
        ratios = [f"{step[e] / ref:.2f}x" if step.get(e) and ref else "-" for e in ("saguaro-sync", "saguaro-async")]
        sag = (by_engine.get("saguaro-async") or {}).get("saguaro", {})
        lookups = sum(v for k, v in sag.items() if k.startswith("cache_lookups_total"))
        hits = sum(v for k, v in sag.items() if k.startswith("cache_hits_total"))
        ring = (by_engine.get("saguaro-async") or {}).get("ring_used_mb")
        out.append(f"| {vocab} | {batch} | {t:g} | " + " | ".join(fmt(step.get(e), ".1f") for e, _ in REAL_VOCAB_ENGINES)
                   + f" | {ratios[0]} | {ratios[1]} | {fmt(hits / lookups if lookups else None, '.2f')} "
                   f"| {fmt(ring, '.0f')} |")
        if batch in (16, 64) and ref:
            for e, name in REAL_VOCAB_ENGINES[2:]:
                if step.get(e):
                    verdict = "met" if step[e] <= ref else f"missed by {100 * (step[e] / ref - 1):.0f} %"
                    checks.append(f"- vocab {vocab}, batch {batch}, T={t:g}: {name} {step[e]:.1f} ms per step "
                                  f"against {ref:.1f} ({verdict})")
    if checks:
        missed = [c for c in checks if not c.endswith("(met)")]
        out += ["", f"Bars on this result: met in {len(checks) - len(missed)} of {len(checks)} "
                "(Saguaro `sync` and `async` per step against `draft_model`, batch 16 and 64, T=0 and T=1)"
                + (":" if missed else "."), *([""] + missed if missed else [])]
    return out + [""]


def load_host_overhead() -> list[dict]:
    """The newest `bench_host_overhead.py` result of each label."""
    newest: dict[str, dict] = {}
    for path in sorted(RESULTS.glob("*-host-overhead-*.json")):
        data = json.loads(path.read_text())
        if data.get("kind") == "host-overhead" and not data.get("label", "").startswith("smoke"):
            data["_file"] = path.name
            if data["label"] not in newest or data["date"] > newest[data["label"]]["date"]:
                newest[data["label"]] = data
    return sorted(newest.values(), key=lambda d: d["label"])


def host_overhead_section(results: list[dict]) -> list[str]:
    """Host time per answer, glue, branch step and jit forward, and transfers per forward, per code tree."""
    out = ["## Host overhead", "",
           "`benchmarks/bench_host_overhead.py`: a compute-free draft (1 layer, hidden 16, one thread), so the time "
           "is the host's: Python, bookkeeping, candidate selection, forks, transfers. Greedy rounds use vocabulary "
           "256; sampled ones the real 128256, where q' over the vocabulary is real CPU work (device work on a GPU): "
           "upper bounds there. Where measured, a time is split into the model's own forward and LM head (its "
           "kernels: device work on a GPU, here the CPU runs them) and the rest, the host (host = total - model). "
           "Goals: a branch step's host time at batch 64 x 32 branches within 2 ms, an answer within 0.3 ms at "
           "batch 1 and 1 ms at 64. A result measured on several code trees is shown for the tree `after` (the "
           "code measured); its file holds the others.", ""]
    for data in results:
        m = data["machine"]
        out += [f"### {data['label']} ({result_link(data['_file'])}, {data['date'][:16]} UTC, commit {data['commit']}; "
                f"{m['cpu']}, {m['cpus']} cores)", "", f"- command: `{data['command']}`"
                + (f"; {data['tree_note']}" if data.get("tree_note") else "")
                + (f"; load average {data['load_avg']['start'][0]:.2f} at the start, {data['load_avg']['end'][0]:.2f} "
                   "at the end" if data.get("load_avg") else ""), "",
                "| T | vocab | batch | budget | tree | answer ms (all hit) | glue ms (host) | branch step ms (host) "
                "| jit ms per forward (host) | transfers per forward |", "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]

        def split(r: dict, name: str) -> str:
            host = r.get(f"{name}_host_ms")
            return fmt(r.get(f"{name}_ms"), ".2f") + (f" ({host:.2f})" if host is not None else "")

        rows = data["results"]
        if any(r.get("tree") == "after" for r in rows):
            rows = [r for r in rows if r.get("tree") == "after"]
        for r in sorted(rows, key=lambda r: (r["temperature"], r["batch"], r["budget"], r.get("tree") or "")):
            out.append(f"| {r['temperature']:g} | {r['vocab']} | {r['batch']} | {r['budget']} | {r.get('tree') or '-'} "
                       f"| {fmt(r.get('answer_ms'), '.2f')} | {split(r, 'glue')} | {split(r, 'branch_step')} "
                       f"| {split(r, 'jit')} | {r['transfers_per_forward']:.1f} |")
        out.append("")
    return out


def load_latest_verify_curve() -> dict | None:
    """The newest result of `benchmarks/verify_curve.py` (`*-verify-curve.json`)."""
    found = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(RESULTS.glob("*-verify-curve.json"))]
    found = [d for d in found if d.get("kind") == "verify-curve"]
    return max(found, key=lambda d: d["date"]) if found else None


def verify_curve_section(data: dict) -> list[str]:
    """Verification ms per batch and drafts per row, and its ratio to the plain decode step (d = 0)."""
    m = data["machine"]
    out = ["## Verification time against drafts per row", "",
           f"`benchmarks/verify_curve.py` ({result_link(data['_file'])}, {data['date'][:16]} UTC): "
           "cost-matched demo pair, "
           f"T=0, {data['max_tokens']} tokens per request; {data['placement']}. Machine: {m['cpu']}, "
           f"{m['cpus']} cores. The target verifies exactly d drafts per row from a free, perfect drafter "
           "(the oracle: its own recorded greedy tokens, no drafter process), so one step takes (tokens per "
           "step) / (tokens per second per sequence): the forward over batch x (1 + d) tokens plus vLLM's "
           "sampling and scheduling; d = 0 is vLLM AR's decode step. This is the cost `depth: \"auto\"` "
           "learns online.", "",
           f"- command: `{data['command']}`", "",
           "| batch | drafts per row d | verification ms | vs d = 0 | accept len |",
           "|---:|---:|---:|---:|---:|"]
    base = {p["batch"]: p["verify_ms"] for p in data["points"] if p["depth"] == 0 and p["verify_ms"]}
    for p in sorted(data["points"], key=lambda p: (p["batch"], p["depth"])):
        ratio = f"{p['verify_ms'] / base[p['batch']]:.2f}x" if p["verify_ms"] and p["batch"] in base else "-"
        out.append(f"| {p['batch']} | {p['depth']} | {fmt(p['verify_ms'], '.1f')} | {ratio} "
                   f"| {fmt(p.get('mean_acceptance_length'))} |")
    return out + ["", "![verification ms against tokens verified per row](img/verify-curve.png)", ""]


def load_latest_ceiling() -> dict | None:
    """The newest result of `benchmarks/ceiling.py` (`*-ceiling.json`)."""
    found = [json.loads(p.read_text()) | {"_file": p.name} for p in sorted(RESULTS.glob("*-ceiling.json"))]
    found = [d for d in found if d.get("kind") == "ceiling"]
    return max(found, key=lambda d: d["date"]) if found else None


def ceiling_section(data: dict) -> list[str]:
    """SSD at fixed K and with `depth: "auto"` against a free, perfect drafter (the oracle) per K."""
    m, summary = data["machine"], data["summary"]
    fixed, auto = f"saguaro-async-k{data['k']}", f"saguaro-async-depth-auto-k{data['max_depth']}"
    out = ["## Depth: SSD against the ceiling of a free, perfect drafter", "",
           f"`benchmarks/ceiling.py` ({result_link(data['_file'])}, {data['date'][:16]} UTC): "
           "cost-matched demo pair, batch 1, "
           f"T=0, {data['num_prompts']} prompts x {data['max_tokens']} tokens, {data['rounds']} interleaved "
           f"rounds; {data['placement']}. Machine: {m['cpu']}, {m['cpus']} cores. The oracle is a vLLM "
           "`custom_class` proposer returning the target's own greedy tokens (recorded first): every draft "
           "accepted at no drafting cost, so no drafter at that K can pass it.", "",
           f"- command: `{data['command']}`", "",
           "| engine | tokens/s per sequence | accept len | hit rate | verification ms |",
           "|---|---:|---:|---:|---:|"]
    for name, s in summary.items():
        out.append(f"| {name} | {s['tok_s_per_seq']:.2f} | {fmt(s['mean_acceptance_length'])} "
                   f"| {fmt(s.get('hit_rate') if name.startswith('saguaro') else None, '.3f')} "
                   f"| {fmt(s.get('verify_ms'), '.1f')} |")
    ceiling = summary.get(f"oracle-k{data['k']}")
    if fixed in summary and auto in summary:
        ci = ratio_ci(summary[auto]["per_seq_tok_s"], summary[fixed]["per_seq_tok_s"])
        ratio = summary[auto]["tok_s_per_seq"] / summary[fixed]["tok_s_per_seq"]
        interval = f" (paired 95 % interval {ci[1]:.2f}-{ci[2]:.2f})" if ci else ""
        out += ["", f"- depth auto / fixed K={data['k']}: {ratio:.2f}x{interval}; bar >= 1.15x: "
                f"{'met' if ratio >= 1.15 else 'missed'}"]
        if ceiling:
            c = summary[auto]["tok_s_per_seq"] / ceiling["tok_s_per_seq"]
            out.append(f"- depth auto / the K={data['k']} ceiling: {c:.2f}x; bar > 1: {'met' if c > 1 else 'missed'}")
    return out + [""]


def device_check_lines() -> list[str]:
    """The GPU check's section: the newest GPU `*-device-check.json`, or that it has not run (device_check.py)."""
    module = sys.modules.get("device_check")
    if module is None:
        spec = importlib.util.spec_from_file_location("device_check", Path(__file__).with_name("device_check.py"))
        module = sys.modules["device_check"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.report_lines(RESULTS)


def case_section(data: dict, title: str, question: str) -> list[str]:
    """One `run.py` case as a section: how it ran, the table, SSD's ratios with intervals, the bars, the plots."""
    m = data["machine"]
    out = [f"## {title}", "", question, "",
           f"{result_link(data['_file'])} ({data['date'][:10]}; {m['cpu']}, {m['cpus']} cores, "
           f"{m['memory_gb']} GiB; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ")",
           f"- command: `{data['command']}`",
           f"- models: {data['models']} (`{model_dir(data['target'])}` / `{model_dir(data['draft'])}`)",
           f"- placement `{data['placement']['mode']}` (target cores {data['placement']['target_cores']}, "
           f"drafter cores {data['placement']['draft_cores']}); {placement_rule(data['placement'])}",
           f"- {data['num_prompts']} group(s) of `batch` concurrent requests per run, {data['max_tokens']} "
           f"output tokens each (ignore_eos), {data['rounds']} interleaved round(s); Saguaro K={data['k']}, "
           f"`draft_model` K tried: {data['k_draft_model']} (best shown)", ""]
    rows = table_rows(data)
    out += case_table(data, rows) + interval_table(data, rows) + [""]
    checks = bars(rows)
    if checks:
        out += ["Bars of the benchmark issue on this result:", ""] + checks + [""]
    for img, caption in plots(data, rows):
        out += [f"![{caption}](img/{img})", ""]
    return out


def load_regimes() -> dict | None:
    """The newest `benchmarks/regimes.py` result (`<date>-regimes-<label>.json`), if any: a `matrix*` label
    (the whole matrix) before any other (a smoke run, or a few cells measured for the notes, beside the
    matrix of the same date must not hide it)."""
    def rank(path: Path) -> tuple[bool, str]:
        return path.stem.split("-regimes-", 1)[1].startswith("matrix"), path.name

    found = sorted(RESULTS.glob("*-regimes-*.json"), key=rank)
    return json.loads(found[-1].read_text()) | {"_file": found[-1].name} if found else None


def _spread(values, runs_said: bool = False) -> str:
    """mean [min-max] (n runs) of a list of tokens/s, or the one value; `runs_said`: the count is in the
    table's header, not in each cell."""
    values = [v for v in (values if isinstance(values, list) else [values]) if v is not None]
    if not values:
        return "-"
    count = "" if runs_said else f" ({len(values)} run{'s' if len(values) > 1 else ''})"
    if len(values) == 1:
        return f"{values[0]:.1f}{count}"
    return f"{sum(values) / len(values):.1f} [{min(values):.0f}-{max(values):.0f}]{count}"


def repeat_ratios(cell: dict, engine: str) -> list[float]:
    """`engine` over `sync` per repeat of a regimes cell (the i-th run of each, interleaved in time)."""
    e = cell.get("engines") or {}
    mine, sync = (e.get(engine) or {}).get("tokens_per_s") or [], (e.get("sync") or {}).get("tokens_per_s") or []
    return [a / s for a, s in zip(mine, sync) if s]


def regimes_plot(data: dict) -> str | None:
    """SSD / `sync` per cell (median and range over repeats) beside `draft_model` / `sync`, with both goals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in data.get("cells") or [] if repeat_ratios(c, "async")]
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(cells)), 3.8))
    for x, c in enumerate(cells):
        for engine, colour, marker in (("async", "tab:green", "o"), ("draft_model", "tab:gray", "x")):
            r = sorted(repeat_ratios(c, engine))
            if r:
                ax.errorbar([x], [r[len(r) // 2]], yerr=[[r[len(r) // 2] - r[0]], [r[-1] - r[len(r) // 2]]],
                            color=colour, marker=marker, ms=4, capsize=2, lw=1,
                            label=("SSD / sync" if engine == "async" else "draft_model / sync") if x == 0 else None)
    goals = data.get("goals") or {}
    for key, colour, style in (("floor", "tab:red", "--"), ("win", "tab:blue", ":")):
        if goals.get(key):
            where = f" ({goals['win_where']})" if key == "win" and goals.get("win_where") else ""
            ax.axhline(goals[key], color=colour, lw=0.8, ls=style, label=f"{key} {goals[key]}{where}")
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"r{c['ratio']:g} {c['vocab'] // 1000}k b{c['batch']} T{c['temperature']:g}" for c in cells],
                       rotation=90, fontsize=6)
    ax.set_ylabel("tokens/s over sync")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    name = "regimes-over-sync.png"
    fig.savefig(IMG / name, dpi=110)
    plt.close(fig)
    return name


def regimes_misses(data: dict) -> list[str]:
    """Each cell below its goal with what was measured there: SSD / `sync` per repeat (below the goal in every
    repeat, or on both sides of it: not decided by these repeats), how far `sync`'s own runs spread, and how
    often SSD pre-drafted and hit."""
    out = []
    for c in data.get("cells") or []:
        if c.get("met", True):
            continue
        ratios = repeat_ratios(c, "async")
        sync = [v for v in ((c.get("engines") or {}).get("sync") or {}).get("tokens_per_s") or [] if v]
        ssd = (c.get("engines") or {}).get("async") or {}
        verdict = ("no repeat with both engines" if not ratios else "below in every repeat"
                   if max(ratios) < c["goal"] else "repeats on both sides: not decided")
        out.append(f"- r{c['ratio']:g} {c['vocab'] // 1000}k b{c['batch']} T{c['temperature']:g}: "
                   f"{' / '.join(f'{r:.2f}' for r in ratios)} (goal {c['goal']}), {verdict}; `sync` spread "
                   + (f"{max(sync) / min(sync):.2f}x" if sync else "-")
                   + f"; pre-drafted {fmt(ssd.get('predraft_share'), '.2f')}, hit rate {fmt(ssd.get('hit_rate'), '.2f')}")
    return ["", f"Cells below their goal ({len(out)}; r: draft/target cost ratio, b: batch; SSD / `sync` per "
                "repeat, `sync`'s fastest over slowest run, SSD's pre-draft share, hit rate; why: "
                "[notes.md](../benchmarks/notes.md#cost-regimes-what-the-misses-are)):", "", *out] if out else []


def regimes_section(data: dict | None) -> list[str]:
    """Cost regimes: per cell (draft/target cost ratio, vocabulary, batch, T) each engine's tokens/s over its
    repeats, and SSD's hit rate and pre-draft share. Written defensively: cells or engines a result lacks are
    shown as "-"."""
    out = ["## Cost regimes", "",
           "Where SSD pays: the same engines under draft/target cost ratios, vocabularies, batches and "
           "temperatures (`benchmarks/regimes.py`). Goals: SSD (`mode: async`, with its [fallback]"
           "(algorithm.md#fallback-when-ssd-drafts-as-sync-does)) at least 0.97x `sync` "
           "in every cell, 1.15x where the draft is cheap "
           "(ratio <= 0.2), batch <= 16, T = 0.", "",
           "vLLM `draft_model` runs with `draft_sample_method: \"probabilistic\"` (vLLM's default, `greedy`, "
           "verifies the draft's argmax as if the draft were certain of it, so at T > 0 few drafts survive) and, "
           "on vLLM 0.32's CPU build, with saguaro-vllm's CPU sampling fix loaded; with both it accepts every "
           "draft of an identical draft at T = 1. Where it accepts little at T > 0, that is those settings, no "
           "merit of SSD.",
           ""]
    if data is None:
        return out + ["No result yet: `benchmarks/results/*-regimes-*.json` is written by `benchmarks/regimes.py`.", ""]
    m = data.get("machine") or {}
    counts = {len(v) if isinstance(v, list) else 1 for c in data.get("cells") or []
              for e in (c.get("engines") or {}).values() if (v := e.get("tokens_per_s")) is not None}
    runs = counts.pop() if len(counts) == 1 else None
    dm = any((c.get("engines") or {}).get("draft_model") for c in data.get("cells") or [])
    each = [] if runs is None else ["Tokens/s per engine and cell: " + (
        "one run." if runs == 1 else f"mean [min-max] of {runs} runs."), ""]
    out += [f"{result_link(data['_file'])} ({str(data.get('date', '?'))[:10]}; {m.get('cpu', '?')}, "
            f"{m.get('cpus', '?')} cores); settings: `{json.dumps(data.get('settings', {}))}`", "",
            *([f"Note: {data['note']}.", ""] if data.get("note") else []), *each,
            "| ratio | vocab | batch | T | `sync` tok/s | SSD tok/s | " + ("`draft_model` tok/s | " if dm else "")
            + "SSD / `sync` (goal) | SSD hit rate | SSD pre-draft share |",
            "|---:|---:|---:|---:|---|---|" + ("---|" if dm else "") + "---:|---:|---:|"]
    for c in data.get("cells") or []:
        e = c.get("engines") or {}
        ssd = e.get("async") or {}
        out.append(f"| {c.get('ratio', '-')} | {c.get('vocab', '-')} | {c.get('batch', '-')} | "
                   f"{c.get('temperature', '-')} | "
                   f"{_spread((e.get('sync') or {}).get('tokens_per_s'), runs is not None)} | "
                   f"{_spread(ssd.get('tokens_per_s'), runs is not None)} | "
                   + (f"{_spread((e.get('draft_model') or {}).get('tokens_per_s'), runs is not None)} | " if dm else "")
                   + f"{fmt(c.get('async_over_sync'), '.2f')} ({c.get('goal', '-')}{'' if c.get('met', True) else ', missed'}) "
                   f"| {fmt(ssd.get('hit_rate'), '.3f')} | {fmt(ssd.get('predraft_share'), '.2f')} |")
    goals = data.get("goals") or {}
    if goals.get("cells"):
        out += ["", f"Goals met in {goals.get('met')} of {goals['cells']} cells."]
    out += regimes_misses(data)
    img = regimes_plot(data)
    if img:
        out += ["", f"![SSD and draft_model over sync per cell, median and range over repeats](img/{img})"]
    return out + [""]


#: The page's questions: (title, the case of benchmarks/cases.json that answers it, what it asks).
CASE_SECTIONS = (
    ("Speed against `sync` and `draft_model`", "cost-matrix",
     "Tokens/s per sequence of every engine on the cost-matched demo pair, batch 1-16, T = 0 / 0.7 / 1. One round "
     "per cell: the spread is the interval over requests; how far a cell moves between runs is under "
     "[Projection](#projection), repeatability."),
    ("Batch", "batch-sweep-32-64", "Larger batches (32, 64): verification grows with the batch, pre-drafting pays "
     "less."),
)


def render(results: list[dict]) -> str:
    """The whole page: one section per question, each from the newest result that answers it."""
    by_name = {d["name"]: d for d in results}
    out = ["# Benchmarks", "",
           "Generated by `benchmarks/report.py` from `benchmarks/results/*.json`: one section per question, each "
           "from the newest result that answers it, with the command, the machine and the spread. Earlier results "
           "stay in git history; analysis and lab notes are in `benchmarks/notes.md`. Reproduce from scratch on a "
           "fresh clone, after `make setup`: `make bench`.", "",
           "Every figure here was measured on CPUs, with the locally trained demo pair ([demo-pair.md](demo-pair.md):"
           " a small target and draft zero-padded to cost like ~400M and ~50M-parameter models); no GPU ran any of "
           "it. The GPU figures under [Projection](#projection) are a replay under a GPU cost model, not a "
           "measurement.", ""]
    for title, name, question in CASE_SECTIONS:
        if name in by_name:
            out += case_section(by_name[name], title, question)
        if name == "cost-matrix":
            out += temperature_section(*headline_inputs())
    out += regimes_section(load_regimes())
    real_vocab = load_real_vocab()
    if real_vocab is not None:
        out += real_vocab_section(real_vocab)
    serve = load_serve()
    if serve is not None:
        out += serve_section(serve)
    host = load_host_overhead()
    if host:
        out += host_overhead_section(host)
    import report_projection

    out += report_projection.summary(DEV_PAGE.relative_to(PAGE.parent).as_posix())
    out += device_check_lines()
    soak = load_latest_soak()
    if soak:
        out += soak_section(soak)
    return "\n".join(out)


def render_dev() -> str:
    """docs/dev/projection-runs.md: the tables the page's Projection section summarises, links rebased there."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import report_projection

    lines = ["# Projection: validation and repeatability runs", "",
             "Generated by `benchmarks/report.py` (with [docs/benchmarks.md](../benchmarks.md), which summarises it).",
             "", *report_projection.detail()]
    return re.sub(r"\]\((?!https?:|#|\.\./benchmarks\.md)([^)]+)\)", r"](../\1)", "\n".join(lines))


README = ROOT / "README.md"
HEADLINE_BEGIN = ("<!-- headline:begin (generated by benchmarks/report.py from the newest "
                  "benchmarks/results/*-repeatability*.json; edits here are overwritten) -->")
HEADLINE_END = "<!-- headline:end -->"


def code_of(result: dict) -> str | None:
    """The commit a result measured: its `commit`, else the one its note names as "code (<hash>)"."""
    if result.get("commit"):
        return result["commit"]
    m = re.search(r"\bcode \(([0-9a-f]{7,40})\)", result.get("note") or "")
    return m.group(1) if m else None


def repeated_table(repeat: dict, validation: dict | None, results_dir: str) -> list[str]:
    """SSD against `sync` per cell of a repeatability result (every run of each cell, not one), with its pair,
    machine, date, code and file; vLLM AR at batch 1 from the validation it repeats. Links to results files
    start with `results_dir` (relative to the page the table goes on)."""
    m = repeat["machine"]
    code = code_of(repeat)
    out = [f"Demo pair (cost-matched), K=5, 256 tokens per request, {m['cpu']} with {m['cpus']} cores (target on "
           f"one, drafter on the other), {repeat['date'][:10]}" + (f", code {code}" if code else "")
           + f"; each cell recorded {min(c['runs'] for c in repeat['cells'])}"
           f" times, every run shown ([{repeat['_file']}]({results_dir}{repeat['_file']})). Tokens/s of the "
           "whole batch:", "",
           "| batch | T | `sync` tokens/s | SSD (`async`) tokens/s | SSD / `sync` (means) | SSD hit rate |",
           "|---:|---:|---|---|---:|---:|"]
    cells = {(c["mode"], c["batch"], c["temperature"]): c for c in repeat["cells"]}
    for (mode, b, t), ssd in sorted(cells.items()):
        sync = cells.get(("sync", b, t))
        if mode != "async" or sync is None:
            continue
        runs = lambda c: " / ".join(f"{x['tokens_per_s']:.1f}" for x in c["measured"])  # noqa: E731
        out.append(f"| {b} | {t:g} | {runs(sync)} | {runs(ssd)} | "
                   f"{ssd['tokens_per_s_mean'] / sync['tokens_per_s_mean']:.2f}x | {fmt(ssd.get('hit_rate_mean'), '.2f')} |")
    widest = max(repeat["cells"], key=lambda c: c.get("tokens_spread") or 0)
    out += ["", f"Between recordings of the same cell the faster run is up to {100 * widest['tokens_spread']:.0f} % "
            f"above the slower ({widest['mode']}, batch {widest['batch']}, T={widest['temperature']:g}): read "
            "single figures with that spread in mind."]
    ar = next((x for x in (validation or {}).get("vllm_ar") or [] if x["batch"] == 1), None)
    if ar is not None:
        out[-1] += (f" vLLM without speculation at batch 1: {ar['measured_per_seq']:.2f} tokens/s (one run, "
                    f"[{validation['_file']}]({results_dir}{validation['_file']})).")
    return out


def headline_block(repeat: dict, validation: dict | None) -> list[str]:
    """The README's figures: the repeated runs' table, between the markers `sync_readme` rewrites."""
    return [HEADLINE_BEGIN, *repeated_table(repeat, validation, "benchmarks/results/"), HEADLINE_END]


def temperature_section(repeat: dict | None, validation: dict | None) -> list[str]:
    """Temperature: SSD against `sync` at T = 0, 0.7 and 1 from the newest repeatability result (the figures
    the README shows)."""
    if repeat is None:
        return []
    return ["## Temperature", "",
            "SSD against `sync` at T = 0, 0.7 and 1, batch 1, 4 and 16, each cell run more than once: the "
            "speculation cache hits less often when the target samples. vLLM AR and `draft_model` at T > 0 are "
            "under [Speed](#speed-against-sync-and-draft_model); the same runs replayed are under "
            "[Projection](#projection).", "",
            *repeated_table(repeat, validation, "../benchmarks/results/"), ""]


def sync_readme(repeat: dict, validation: dict | None, path: Path = README) -> bool:
    """Rewrite the README's generated headline block; False (README untouched) without its markers."""
    text = path.read_text()
    if HEADLINE_BEGIN not in text or HEADLINE_END not in text:
        return False
    head, rest = text.split(HEADLINE_BEGIN, 1)
    path.write_text(head + "\n".join(headline_block(repeat, validation)) + rest.split(HEADLINE_END, 1)[1])
    return True


def headline_inputs() -> tuple[dict | None, dict | None]:
    """The newest repeatability result and the validation it repeats (by the file it names)."""
    found = sorted(RESULTS.glob("*-repeatability*.json"))
    if not found:
        return None, None
    repeat = json.loads(found[-1].read_text()) | {"_file": found[-1].name}
    name = (repeat.get("against_validation") or {}).get("validation")
    validation = json.loads((RESULTS / name).read_text()) | {"_file": name} if name and (RESULTS / name).exists() else None
    return repeat, validation


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    results = load_latest()
    if not results:
        print(f"no end-to-end results in {RESULTS}; run benchmarks/run.py first", file=sys.stderr)
        return 1
    PAGE.write_text(render(results))
    print(f"wrote {PAGE} from {', '.join(d['_file'] for d in results)}")
    DEV_PAGE.write_text(render_dev())
    print(f"wrote {DEV_PAGE}")
    repeat, validation = headline_inputs()
    if repeat is not None and sync_readme(repeat, validation):
        print(f"wrote the headline block of {README} from {repeat['_file']}")
    soak = load_latest_soak()
    if soak and sync_troubleshooting(soak):
        print(f"wrote the soak block of {TROUBLESHOOTING} from {soak['_file']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
