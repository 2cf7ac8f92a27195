"""The soak's figures on the pages come from its newest result file (benchmarks/results/*-soak.json): the
benchmarks page's section and the generated blocks of docs/dev/troubleshooting.md (Memory; When the drafter fails),
so neither can drift from the data again (issue 25: the page once said every replacement drafter was flat where
the result said it was not measured). The newest result is the soak issue 44 asked for: mixed traffic through
`vllm serve` under drafter SIGKILLs and SIGSTOPs, greedy outputs replayed on plain vLLM, with SSD at work
(itself with `fallback: off`, or a same-day companion with it beside the plugin's defaults)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from saguaro_vllm.tools.server_process import sample_labels

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report_soak", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _report()
SOAK = report.load_latest_soak()


def _counter(data: dict, name: str, **labels: str) -> float:
    """A dashboard counter at the soak's end, summed over the labels not given (`engine`, absent in older
    results, among them)."""
    counters = data["dashboard"]["summary"]["counters"]
    return sum(v for k, v in counters.items()
               if k.split("{", 1)[0] == name and labels.items() <= sample_labels(k).items())


def _fallback(data: dict) -> str:
    return (data["settings"].get("saguaro") or {}).get("fallback", "auto")


def test_newest_soak_measured_ssd_and_every_drafter():
    """The result the pages show exercised SSD and measured every drafter process that lived past its settle
    time, replacements included (scheduled faults' and the plugin's own): any that was not lived under a
    minute."""
    assert SOAK is not None, "no benchmarks/results/*-soak.json"
    drafters = SOAK["memory"].get("drafters")
    replaced = len(SOAK.get("unexpected_replacements") or [])
    # one memory entry per drafter process: the first and one per restart (the last restart's replacement may
    # not have started before the end)
    assert drafters and len(SOAK["kills"]) + replaced <= len(drafters) <= len(SOAK["kills"]) + replaced + 1
    assert all(d["growth"] is not None or d["alive_t_s"][1] - d["alive_t_s"][0] < 60 for d in drafters), \
        "a drafter process that lived long enough was not measured"
    assert SOAK["speculation"]["cache_hit_rate"] is not None and "hit_rate_windows" in SOAK["speculation"]


def test_newest_soak_is_the_mixed_soak_under_faults():
    """No request failed; faults of both kinds, each recovered (a stopped drafter killed by the plugin); every
    kind of traffic ran; every greedy request equals plain vLLM's output; SSD hit (the 12-04 soak's 0.001 said
    nothing about SSD); memory, the dashboard and the plot were recorded over the whole run."""
    s, st, sp = SOAK["summary"], SOAK["settings"], SOAK["speculation"]
    assert SOAK["errors"] == 0 and st["duration_s"] >= 1800
    assert {k["signal"] for k in SOAK["kills"]} == {"SIGKILL", "SIGSTOP"}
    assert all(k["recovered_after_s"] is not None and k["restarts"] >= 1 for k in SOAK["kills"])
    assert all(k["gone_after_s"] is not None for k in SOAK["kills"] if k["signal"] == "SIGSTOP")
    assert SOAK["speculation_disabled_at_s"] is None and SOAK["server_log_tracebacks_before_stop"] == 0
    # every restart is a scheduled fault or a replacement the result lists, with the plugin's reason and /proc
    extra = SOAK["unexpected_replacements"]
    restarts = _counter(SOAK, "vllm:saguaro_drafter_restarts_total")
    assert restarts == len(SOAK["kills"]) + len(extra)
    assert all(r["log"] and r["last_samples"] for r in extra)
    assert {"0", "0.7", "1"} <= set(s["by_temperature"])
    for kind in ("streamed_requests", "non_streamed_requests", "cancelled_requests", "n_gt_1_requests",
                 "long_prompt_requests", "chat_requests"):
        assert s[kind] > 0, kind
    g = SOAK["greedy_check"]
    assert g["compared"] == g["greedy_requests"] > 0 and g["compared_as_prefix"] > 0 and g["mismatches"] == 0
    # SSD hit: with `fallback: off` every round pre-drafts; with the default (`auto`) the drafter pre-drafts
    # where it measured that to pay, and a same-day companion soak with `off` must show the machinery under
    # load (branches every round) through the same faults
    ssd_soaks = [SOAK] if _fallback(SOAK) == "off" else [
        d for d in report.soak_companions(SOAK) if _fallback(d) == "off" and d["settings"]["duration_s"] >= 1800]
    if _fallback(SOAK) != "off":
        assert sp["cache_hit_rate"] > 0.01 and _counter(SOAK, "vllm:saguaro_rounds_total", mode="predraft") > 0
    assert ssd_soaks, "no 30-minute soak with every round pre-drafting (fallback: off)"
    for d in ssd_soaks:
        assert d["speculation"]["cache_hit_rate"] > 0.1 and d["speculation"]["predraft_share"] > 0.5, d["_file"]
        assert d["errors"] == 0 and d["greedy_check"]["mismatches"] == 0 and d["greedy_check"]["compared"] > 0
        assert {k["signal"] for k in d["kills"]} == {"SIGKILL", "SIGSTOP"}, d["_file"]
    dash = SOAK["dashboard"]
    times = [d["t"] for d in dash["samples"]]
    assert max(b - a for a, b in zip(times, times[1:])) < 2 * dash["every_s"] and times[-1] >= st["duration_s"]
    assert any(k.startswith("vllm:saguaro_drafter_state") for k in dash["samples"][-1]["samples"])
    mem = SOAK["memory"]
    times = [x["t"] for x in mem["process_samples"]]
    assert max(b - a for a, b in zip(times, times[1:])) < 15 and times[-1] >= st["duration_s"]
    assert {p["role"] for p in mem["processes"].values()} >= {"server", "engine core", "worker", "drafter"}
    assert (report.RESULTS / SOAK["plot"]).exists()
    # flat (fitted change under 5 % over the measured span): the API server, the engine core and every drafter
    # measured; the worker is what the page reports as not flat (vLLM's own, see the plain reference run)
    for pid, p in mem["processes"].items():
        if p["role"] in ("server", "engine core", "drafter") and report.fitted_change(p) is not None:
            assert abs(report.fitted_change(p)) < 0.05, (pid, p)
    assert sum(report.fitted_change(p) is not None for p in mem["processes"].values() if p["role"] == "drafter") >= 4


def test_benchmarks_section_shows_the_result_files_figures():
    text = "\n".join(report.soak_section(SOAK))
    s, m, sp = SOAK["summary"], SOAK["memory"], SOAK["speculation"]
    assert f"result [{SOAK['_file']}](../benchmarks/results/{SOAK['_file']})" in text
    assert f"| {s['requests']} | {SOAK['errors']} | {s['tokens_per_s']:.1f} |" in text
    assert f"speculation-cache hit rate {sp['cache_hit_rate']:.3f}" in text
    for w in (sp["hit_rate_windows"].get("before_kill"), sp["hit_rate_windows"].get("after_recovery")):
        if w:
            assert f"{w['hit_rate']:.3f} ({w['from_t_s']:.0f}-{w['to_t_s']:.0f} s" in text
    for role, start in m["start_mb"].items():
        if role != "drafter":
            assert f"| {role} | {m['start_t_s']:.0f} - {m['end_t_s']:.0f} | {start:.0f} | {m['end_mb'][role]:.0f} | " \
                   f"{100 * m['growth'][role]:+.1f} % |" in text
    for d in m["drafters"]:
        if d["growth"] is None:
            assert f"| drafter, {d['which']} (pid {d['pid']}) | not measured (ran too short) |" in text
            continue
        assert f"| drafter, {d['which']} (pid {d['pid']}) | {d['from_t_s']:.0f} - {d['to_t_s']:.0f} | " \
               f"{d['start_mb']:.1f} | {d['end_mb']:.1f} | {100 * d['growth']:+.1f} % |" in text
    for kill in SOAK["kills"]:
        assert f"drafts flowing again after {kill['recovered_after_s']:.1f} s" in text
    others = SOAK["load"]["other_cpu_s_total"]
    assert (f"Other processes used {others:.0f} CPU-seconds" in text) == (others > 5)
    for kill in SOAK["kills"]:
        assert f"- drafter {kill['signal']} at {kill['at_s']:.0f} s with {kill['requests_in_flight']} requests" in text
        if kill["signal"] == "SIGSTOP":
            assert f"the stopped process gone after {kill['gone_after_s']:.1f} s" in text
    g = SOAK["greedy_check"]
    assert f"{g['compared']} of {g['greedy_requests']} greedy requests compared token for token" in text
    assert f"**{g['mismatches']} mismatches**" in text
    assert (f"| {s['greedy_requests']} | {s['sampled_requests']} | {s['streamed_requests']} | "
            f"{s['non_streamed_requests']} | {s['cancelled_requests']} | {s['n_gt_1_requests']} ({s['choices']}) | "
            f"{s['long_prompt_requests']} | {s['chat_requests']} |") in text
    dev = (ROOT / "docs" / "dev" / "troubleshooting.md").read_text()
    for pid, p in m["processes"].items():  # every measured process's fitted change, on the developer page
        if (f := report.fitted_change(p)) is not None and p["role"] != "other":
            assert f"{p['role']} {pid} {100 * f:+.1f} %" in dev, pid
    assert f"sampled every {SOAK['dashboard']['every_s']:g} s, {len(SOAK['dashboard']['samples'])} samples" in text
    assert f"rounds that pre-drafted: {100 * sp['predraft_share']:.0f} %" in text
    assert f"](../benchmarks/results/{SOAK['plot']})" in text
    assert f"drafters the plugin replaced on its own (no scheduled fault): {len(SOAK['unexpected_replacements'])}" \
        in text
    for r in SOAK["unexpected_replacements"]:
        assert f"  - pid {r['pid']}, last seen at {r['last_seen_s']:.0f} s: " in text
    for d in report.soak_companions(SOAK):
        assert report.companion_line(d) in text
    for pid, p in m["processes"].items():
        f = report.fitted_change(p)
        if f is not None:  # a process whose fitted change is 5 % or more is named as not flat
            assert (f"{p['role']} {pid} ({100 * f:+.1f} %)" in text) == (abs(f) >= 0.05)


def test_troubleshooting_block_is_generated_from_the_newest_soak():
    page = (ROOT / "docs" / "dev" / "troubleshooting.md").read_text()
    assert page.count(report.SOAK_BEGIN) == 1 and page.count(report.SOAK_END) == 1
    block = page.split(report.SOAK_BEGIN, 1)[1].split(report.SOAK_END, 1)[0]
    want = "\n".join(report.soak_memory_block(SOAK)[1:-1])
    assert block.strip("\n") == want, "docs/dev/troubleshooting.md is stale: run benchmarks/report.py"
    m = SOAK["memory"]
    assert SOAK["_file"] in block and f"hit rate {SOAK['speculation']['cache_hit_rate']:.3f}" in block
    for d in m["drafters"]:
        if d["growth"] is None:
            assert f"{d['which']} (pid {d['pid']}) not measured" in block
            continue
        assert f"{d['which']} (pid {d['pid']}) {100 * d['growth']:+.1f} % ({d['start_mb']:.1f} -> " \
               f"{d['end_mb']:.1f} MB" in block
    assert f"worker {100 * m['growth']['worker']:+.1f} %" in block
    # outside the block, the page states no soak figure of its own about the drafters
    outside = page.replace(block, "")
    assert "for every replacement drafter too" not in outside


def test_troubleshooting_faults_block_is_generated_from_the_newest_soak():
    page = (ROOT / "docs" / "dev" / "troubleshooting.md").read_text()
    assert page.count(report.SOAK_FAULTS_BEGIN) == 1 and page.count(report.SOAK_FAULTS_END) == 1
    block = page.split(report.SOAK_FAULTS_BEGIN, 1)[1].split(report.SOAK_FAULTS_END, 1)[0]
    assert block.strip("\n") == "\n".join(report.soak_faults_block(SOAK)[1:-1]), \
        "docs/dev/troubleshooting.md is stale: run benchmarks/report.py"
    g = SOAK["greedy_check"]
    assert SOAK["_file"] in block and f"failed requests {SOAK['errors']}" in block
    assert f"({g['mismatches']} mismatches)" in block
    for sig in {k["signal"] for k in SOAK["kills"]}:
        assert f" {sig}" in block


def test_sync_rewrites_only_the_block(tmp_path):
    page = tmp_path / "t.md"
    page.write_text(f"before\n{report.SOAK_BEGIN}\nold figures\n{report.SOAK_END}\nafter\n")
    assert report.sync_troubleshooting(SOAK, page)
    text = page.read_text()
    assert text.startswith(f"before\n{report.SOAK_BEGIN}\n") and text.endswith(f"{report.SOAK_END}\nafter\n")
    assert "old figures" not in text and SOAK["_file"] in text
    page.write_text(f"a\n{report.SOAK_BEGIN}\nx\n{report.SOAK_END}\nb\n{report.SOAK_FAULTS_BEGIN}\ny\n"
                    f"{report.SOAK_FAULTS_END}\nc\n")
    assert report.sync_troubleshooting(SOAK, page)
    text = page.read_text()
    assert text.startswith(f"a\n{report.SOAK_BEGIN}\n") and text.endswith(f"{report.SOAK_FAULTS_END}\nc\n")
    assert "\nx\n" not in text and "\ny\n" not in text and f"{report.SOAK_END}\nb\n{report.SOAK_FAULTS_BEGIN}" in text
    page.write_text("no markers\n")
    assert not report.sync_troubleshooting(SOAK, page) and page.read_text() == "no markers\n"
