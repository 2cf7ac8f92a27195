"""The soak's figures on the pages come from its newest result file (benchmarks/results/*-soak.json): the
benchmarks page's section and the generated block of docs/troubleshooting.md (Memory), so neither can drift
from the data again (issue 25: the page once said every replacement drafter was flat where the result said it
was not measured)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report_soak", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _report()
SOAK = report.load_latest_soak()


def test_newest_soak_measured_ssd_and_every_drafter():
    """The result the pages show exercised SSD and measured every drafter process, replacements included."""
    assert SOAK is not None, "no benchmarks/results/*-soak.json"
    drafters = SOAK["memory"].get("drafters")
    assert drafters and len(drafters) == len(SOAK["kills"]) + 1, "one memory entry per drafter process"
    assert all(d["growth"] is not None for d in drafters), "a drafter process was not measured"
    assert SOAK["speculation"]["cache_hit_rate"] is not None and "hit_rate_windows" in SOAK["speculation"]


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
        assert f"| drafter, {d['which']} (pid {d['pid']}) | {d['from_t_s']:.0f} - {d['to_t_s']:.0f} | " \
               f"{d['start_mb']:.1f} | {d['end_mb']:.1f} | {100 * d['growth']:+.1f} % |" in text
    for kill in SOAK["kills"]:
        assert f"drafts flowing again after {kill['recovered_after_s']:.1f} s" in text
    others = SOAK["load"]["other_cpu_s_total"]
    assert (f"Other processes used {others:.0f} CPU-seconds" in text) == (others > 5)


def test_troubleshooting_block_is_generated_from_the_newest_soak():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert page.count(report.SOAK_BEGIN) == 1 and page.count(report.SOAK_END) == 1
    block = page.split(report.SOAK_BEGIN, 1)[1].split(report.SOAK_END, 1)[0]
    want = "\n".join(report.soak_memory_block(SOAK)[1:-1])
    assert block.strip("\n") == want, "docs/troubleshooting.md is stale: run benchmarks/report.py"
    m = SOAK["memory"]
    assert SOAK["_file"] in block and f"hit rate {SOAK['speculation']['cache_hit_rate']:.3f}" in block
    for d in m["drafters"]:
        assert f"{d['which']} (pid {d['pid']}) {100 * d['growth']:+.1f} % ({d['start_mb']:.1f} -> " \
               f"{d['end_mb']:.1f} MB" in block
    assert f"worker {100 * m['growth']['worker']:+.1f} %" in block
    # outside the block, the page states no soak figure of its own about the drafters
    outside = page.replace(block, "")
    assert "for every replacement drafter too" not in outside


def test_sync_rewrites_only_the_block(tmp_path):
    page = tmp_path / "t.md"
    page.write_text(f"before\n{report.SOAK_BEGIN}\nold figures\n{report.SOAK_END}\nafter\n")
    assert report.sync_troubleshooting(SOAK, page)
    text = page.read_text()
    assert text.startswith(f"before\n{report.SOAK_BEGIN}\n") and text.endswith(f"{report.SOAK_END}\nafter\n")
    assert "old figures" not in text and SOAK["_file"] in text
    page.write_text("no markers\n")
    assert not report.sync_troubleshooting(SOAK, page) and page.read_text() == "no markers\n"
