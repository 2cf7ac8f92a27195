"""The benchmark harness without engines: cases are data, runs interleave engines within each round, the
report picks draft_model's best K, checks the bars and draws its plots."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


run = _load("run")
report = _load("report")


def test_make_bench_names_one_run_by_one_date(monkeypatch):
    """`make bench` fixes BENCH_DATE once and exports it: every path its steps read names that date (none asks
    `date` again), and the scripts name their result files by it."""
    import subprocess

    proc = subprocess.run(["make", "-n", "bench", "BENCH_DATE=2001-02-03"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert "date +" not in proc.stdout
    assert "traces/2001-02-03-demo-pair-b1b4b16-256 " in proc.stdout
    assert "results/2001-02-03-verify-curve.json" in proc.stdout
    assert "results/2001-02-03-validate-projection-b1b4b16-256.json" in proc.stdout
    monkeypatch.setenv("BENCH_DATE", "2001-02-03")
    assert run.run_date() == "2001-02-03"
    monkeypatch.delenv("BENCH_DATE")
    import datetime

    assert run.run_date() == datetime.date.today().isoformat()


def test_cases_are_valid_run_options():
    cases = json.loads((ROOT / "benchmarks" / "cases.json").read_text())
    for name in (k for k in cases if not k.startswith("_")):
        args = run.parse_args(["--case", name])
        assert args.name == name
        for key, value in cases[name].items():
            assert getattr(args, key) == value


def test_runs_interleave_engines_and_pin_only_vllm_engines_in_split_placement():
    args = run.parse_args(["--batch-sizes", "1,4", "--temperatures", "0", "--rounds", "2", "--k-draft-model", "3,5"])
    runs = run.build_runs(args, "/draft")
    engines = ["vllm-ar", "vllm-draft_model-k3", "vllm-draft_model-k5", "saguaro-sync", "saguaro-async"]
    assert [r["engine"] for r in runs] == engines * 4
    assert [r["round"] for r in runs] == [0] * 10 + [1] * 10
    assert all((r["pin"] == [0]) == r["engine"].startswith("vllm-") for r in runs)
    assert runs[-1]["spec"]["saguaro"] == {"mode": "async", "log_interval_s": 0, "target_cores": [0],
                                          "draft_cores": [1]}
    equal = run.build_runs(run.parse_args(["--placement", "equal", "--batch-sizes", "1"]), "/d")
    assert all(r["pin"] is None for r in equal)


def test_sweep_runs_only_async_variants():
    args = run.parse_args(["--sweep", "--sweep-k", "4,5", "--sweep-scale", "1,0.5", "--batch-sizes", "1",
                           "--temperatures", "1"])
    runs = run.build_runs(args, "/d")
    assert len(runs) == 4 and all(r["engine"].startswith("saguaro-async[") for r in runs)
    assert {r["spec"]["num_speculative_tokens"] for r in runs} == {4, 5}
    assert {r["spec"]["saguaro"]["sampling_scale"] for r in runs} == {1.0, 0.5}


def _result(engine, b, t, speed, **extra):
    return {"engine": engine, "round": 0, "batch": b, "temperature": t, "decode_tok_s_per_seq": speed,
            "total_tok_s": speed * b, "ttft_s": 0.5, "mean_acceptance_length": 3.0 if engine != "vllm-ar" else None,
            "acceptance_rate": 0.6, "peak_memory_mb": {"engine": 1000.0}, **extra}


def test_report_tables_bars_and_plots(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    results = []
    for b in (1, 4):
        for t in (0.0, 1.0):
            results += [_result("vllm-ar", b, t, 6.0), _result("vllm-draft_model-k3", b, t, 11.0),
                        _result("vllm-draft_model-k5", b, t, 12.0), _result("saguaro-sync", b, t, 12.5),
                        _result("saguaro-async", b, t, 17.0 if t == 0 else 12.0, hit_rate=0.9 if t == 0 else 0.5,
                                predraft_ms=150.0, verify_ms=180.0)]
    data = {"name": "unit", "_file": "2026-12-02-unit.json", "date": "2026-12-02T00:00:00", "command": "run.py", "models": "cost",
            "target": "/t", "draft": "/d", "num_prompts": 1, "max_tokens": 8, "rounds": 1, "k": 5,
            "k_draft_model": "3,5", "machine": {"cpu": "x", "cpus": 2, "memory_gb": 24, "platform": "linux",
                                                "versions": {"vllm": "0.32.0"}},
            "placement": {"mode": "split", "rule": "r", "target_cores": "0", "draft_cores": "1"},
            "results": results}
    page = "\n".join(report.case_section(data, "Unit", "What the unit case asks."))
    assert "| 1 | 0 | vLLM `draft_model` K=5 | 12.00 |" in page  # the best K is shown
    assert "SSD >= 1.5x vLLM `draft_model` (batch 1, T=0): 1.42x, **not met**" in page
    assert "SSD >= 1.3x Saguaro `sync` (batch 1, T=0): 1.36x, met" in page
    assert "hit rate >= 0.6 at T=1 (batch 1): 0.500, **not met**" in page
    assert "worst 0.960x" in page
    for img in ("unit-throughput.png", "unit-speedup.png", "unit-temperature.png"):
        assert (tmp_path / "img" / img).stat().st_size > 1000 and f"img/{img}" in page


def test_benchmarks_page_is_current(tmp_path, monkeypatch):
    """docs/benchmarks.md is what `benchmarks/report.py` writes from benchmarks/results/ (run it after a bench)."""
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    page = report.render(report.load_latest())
    assert page == (ROOT / "docs" / "benchmarks.md").read_text(), "run: .venv/bin/python benchmarks/report.py"
    assert "benchmarks/notes.md" in page and "## Summary and analysis" not in page  # lab notes stay out
    assert report.render_dev() == report.DEV_PAGE.read_text(), "run: .venv/bin/python benchmarks/report.py"
    assert "(dev/projection-runs.md)" in page and "cells within the bars" in report.render_dev()


def test_readme_figures_are_current():
    """The README's measured figures are the block report.py writes from the newest repeatability result."""
    repeat, validation = report.headline_inputs()
    block = "\n".join(report.headline_block(repeat, validation))
    assert block in (ROOT / "README.md").read_text(), "run: .venv/bin/python benchmarks/report.py"
    assert f"(benchmarks/results/{repeat['_file']})" in block and "| 1 | 0 | 19.6 / 19.4 | 24.4 / 38.2 |" in block
    # The hand-written line after the block names the code the block measured; a new result needs it rewritten.
    stated = re.search(r"^Code ([0-9a-f]{7,40}) predates the fallback", (ROOT / "README.md").read_text(), re.M)
    assert stated is None or f"code {stated.group(1)};" in block, "README: the code named after the figures"


def test_cost_regimes_section_reads_what_it_finds(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    assert "No result yet" in "\n".join(report.regimes_section(None))
    data = {"_file": "2027-01-01-regimes.json", "machine": {"cpu": "x", "cpus": 2}, "date": "2027-01-01T00:00",
            "settings": {"k": 5}, "cells": [
                {"ratio": 0.05, "vocab": 32000, "batch": 1, "temperature": 0, "async_over_sync": 1.45, "goal": 1.15,
                 "met": True,
                 "engines": {"sync": {"tokens_per_s": [10.0, 12.0]}, "async": {"tokens_per_s": [15.0, 16.0, 17.0],
                             "hit_rate": 0.91, "predraft_share": 0.4}}},
                {"ratio": 1.0, "vocab": 32000, "batch": 16, "temperature": 1, "async_over_sync": 0.9, "goal": 0.97,
                 "met": False, "engines": {}},
                {"ratio": 0.5, "batch": 4, "engines": {}}]}
    text = "\n".join(report.regimes_section(data))
    assert ("| 0.05 | 32000 | 1 | 0 | 11.0 [10-12] (2 runs) | 16.0 [15-17] (3 runs) | 1.45 (1.15) "
            "| 0.910 | 0.40 |") in text
    assert "`draft_model` tok/s" not in text  # no cell ran it: no column
    assert "| 0.90 (0.97, missed) |" in text
    assert "Cells below their goal (1;" in text and "- r1 32k b16 T1: " in text and "no repeat with both" in text
    assert (tmp_path / "img" / "regimes-over-sync.png").exists()  # SSD / sync per repeat, plotted
    assert "| 0.5 | - | 4 | - | - | - | - (-) | - | - |" in text
    same = data | {"cells": data["cells"][:1]}  # every engine ran alike: the count once, in the header
    same["cells"][0]["engines"]["sync"]["tokens_per_s"] = [10.0, 11.0, 12.0]
    same["cells"][0]["engines"]["draft_model"] = {"tokens_per_s": [7.0, 8.0, 9.0]}
    text = "\n".join(report.regimes_section(same))
    assert "Tokens/s per engine and cell: mean [min-max] of 3 runs." in text
    assert "| 0.05 | 32000 | 1 | 0 | 11.0 [10-12] | 16.0 [15-17] | 8.0 [7-9] | 1.45 (1.15) |" in text


def test_cost_regimes_misses_say_whether_the_repeats_decide(tmp_path, monkeypatch):
    """A cell below its goal in every repeat is a miss; one whose repeats lie on both sides is undecided."""
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    cell = {"ratio": 1.0, "vocab": 128256, "batch": 64, "temperature": 0, "goal": 0.97, "met": False,
            "engines": {"sync": {"tokens_per_s": [100.0, 110.0]}, "async": {"tokens_per_s": [80.0, 99.0],
                                                                        "hit_rate": 0.0, "predraft_share": 0.1}}}
    text = "\n".join(report.regimes_misses({"cells": [cell]}))
    assert "- r1 128k b64 T0: 0.80 / 0.90 (goal 0.97), below in every repeat; `sync` spread 1.10x" in text
    cell["engines"]["async"]["tokens_per_s"] = [80.0, 120.0]
    assert "repeats on both sides: not decided" in "\n".join(report.regimes_misses({"cells": [cell]}))
    assert report.regimes_misses({"cells": [cell | {"met": True}]}) == []


def test_cost_regimes_prefers_the_matrix_to_a_smoke_or_partial_run(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    (tmp_path / "2027-01-01-regimes-smoke.json").write_text('{"note": "smoke"}')
    assert report.load_regimes()["note"] == "smoke"  # only a smoke run: it is shown
    (tmp_path / "2027-01-01-regimes-matrix.json").write_text('{"note": "matrix"}')
    (tmp_path / "2027-01-02-regimes-smoke.json").write_text('{"note": "later smoke"}')
    (tmp_path / "2027-01-02-regimes-t1-steps.json").write_text('{"note": "a few cells for the notes"}')
    assert report.load_regimes()["note"] == "matrix"
    (tmp_path / "2027-01-03-regimes-matrix2.json").write_text('{"note": "matrix2"}')
    assert report.load_regimes()["note"] == "matrix2"


def test_sweep_report(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    results = [_result("saguaro-async[k=5,budget=auto,C=%g]" % c, 1, 1.0, 10.0, hit_rate=h,
                       sweep={"k": 5, "budget": "auto", "scale": c})
               for c, h in ((1.0, 0.5), (0.5, 0.6), (0.25, 0.7))]
    lines = report.sweep_section({"name": "sw", "results": results})
    assert len([line for line in lines if line.startswith("| 5 | auto |")]) == 3
    assert (tmp_path / "img" / "sw-sweep.png").exists()


@pytest.mark.parametrize("argv", [["--case", "nope"]])
def test_unknown_case_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(argv)
    assert "not in benchmarks/cases.json" in capsys.readouterr().err


def test_ssd_figures_read_the_labelled_samples():
    delta = {
        'vllm:saguaro_cache_lookups_total{depth="0"}': 4.0, 'vllm:saguaro_cache_lookups_total{depth="5"}': 6.0,
        'vllm:saguaro_cache_hits_total{depth="0"}': 3.0, 'vllm:saguaro_cache_hits_total{depth="5"}': 6.0,
        'vllm:saguaro_backups_total{kind="jit"}': 1.0, "vllm:saguaro_drafter_step_seconds_count": 10.0,
        "vllm:saguaro_drafter_step_seconds_sum": 0.5, "vllm:saguaro_drafter_compute_seconds_sum": 0.2,
        "vllm:saguaro_predraft_seconds_count": 10.0, "vllm:saguaro_predraft_seconds_sum": 1.5,
        "vllm:saguaro_verify_seconds_sum": 2.0,
    }
    f = run.ssd_figures(delta)
    assert f["hit_rate"] == 0.9 and f["hit_rate_by_depth"] == {"0": 0.75, "5": 1.0}
    assert f["backups"] == {"jit": 1.0, "ngram": 0.0} and f["lookups"] == 10.0
    assert f["drafter_wait_ms"] == pytest.approx(50.0) and f["drafter_compute_ms"] == pytest.approx(20.0)
    assert f["predraft_ms"] == pytest.approx(150.0) and f["verify_ms"] == pytest.approx(200.0)


def _soak():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # soak.py imports run.machine_info as `run`
    try:
        return _load("soak")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_soak_memory_growth_measures_a_replaced_drafter_from_its_own_warmup():
    soak = _soak()

    def sample(t, pid, drafter, worker):
        return {"t": t, "drafter_pid": pid, "mb": {"drafter": drafter, "worker": worker}}

    samples = [sample(10, 1, 900, 1000), sample(30, 1, 1000, 1010), sample(60, 1, 1010, 1020),
               sample(90, 2, 700, 1030), sample(120, 2, 1100, 1040), sample(150, 2, 1110, 1045)]
    end = sample(180, 2, 1120, 1048)
    events = {"memory_samples": [*samples, end], "memory_start": samples[1], "memory_end": end}
    got = soak.memory_growth(events, warmup_s=30, kills=[{"at_s": 70, "ready_after_s": 15}], settle_s=30)
    # worker: from its warm-up sample (t=30); drafter: the replacement's first sample >= 85 + 30 s (t=120)
    assert got["from"] == {"drafter": 120, "worker": 30}
    assert got["growth"] == {"drafter": round(20 / 1100, 4), "worker": round(38 / 1010, 4)} and got["ok"]
    assert got["second_half_growth"]["drafter"] == round(10 / 1110, 4)  # midpoint 150 s
    assert "replacement 1 (pid 2)" in got["notes"]["drafter"] and len(got["samples"]) == 7
    # each drafter over its own life: the first from the warm-up to its last sample, the replacement from t=120
    assert [(d["pid"], d["from_t_s"], d["to_t_s"], d["growth"]) for d in got["drafters"]] == [
        (1, 30, 60, round(10 / 1000, 4)), (2, 120, 180, round(20 / 1100, 4))] and got["all_drafters_measured"]
    short = soak.memory_growth(events, 30, [{"at_s": 70, "ready_after_s": 15}], settle_s=90)  # from 175 s: 1 sample
    assert short["drafters"][1]["growth"] is None and not short["all_drafters_measured"] and not short["ok"]
    leaking = {**events, "memory_end": sample(180, 2, 1120, 1200)}
    leaking["memory_samples"] = [*samples, leaking["memory_end"]]
    assert not soak.memory_growth(leaking, 30, [{"at_s": 70, "ready_after_s": 15}], 30)["ok"]


def test_soak_kill_jumps_compare_each_kill_with_the_settled_replacement():
    soak = _soak()
    samples = [{"t": t, "mb": {"drafter": 900, "worker": w}} for t, w in
               [(10, 1000), (20, 1000), (40, 1090), (50, 1090), (60, 1090), (80, 1091), (100, 1091)]]
    kills = [{"at_s": 25, "ready_after_s": 5}, {"at_s": 65, "ready_after_s": 12}, {"at_s": 95, "ready_after_s": 30}]
    got = soak.kill_jumps({"memory_samples": samples}, kills)
    # the first kill grew the worker by 90 MB, the second by 1 (a one-time fill); the third never settled
    assert got == [{"at_s": 25, "from_t_s": 20, "to_t_s": 40, "mb": {"worker": 90}},
                   {"at_s": 65, "from_t_s": 60, "to_t_s": 100, "mb": {"worker": 1}}]
    assert soak.parse_args(["--kill-at", "200,100", "--duration", "300"]).kill_at == [100.0, 200.0]
    assert soak.parse_args(["--no-kill"]).kill_at == []
    with pytest.raises(SystemExit):
        soak.parse_args(["--kill-at", "400", "--duration", "300"])


def test_soak_fault_schedule_and_the_full_preset():
    soak = _soak()
    a = soak.parse_args(["--duration", "1800", "--fault-every", "360"])
    assert a.faults == [(180.0, "SIGKILL"), (540.0, "SIGSTOP"), (900.0, "SIGKILL"), (1260.0, "SIGSTOP"),
                        (1620.0, "SIGKILL")]
    assert a.kill_at == [180.0, 900.0, 1620.0] and a.stop_at == [540.0, 1260.0]
    a = soak.parse_args(["--stop-at", "50", "--duration", "100"])
    assert a.faults == [(50.0, "SIGSTOP")] and a.kill_at == []  # a SIGSTOP alone: no default kill beside it
    a = soak.parse_args(["--kill-at", "30", "--stop-at", "60", "--duration", "100"])
    assert a.faults == [(30.0, "SIGKILL"), (60.0, "SIGSTOP")]
    full = soak.parse_args(["--full", "--duration", "1800"])
    assert full.models == "embedded" and full.compare_greedy and full.clients == 4 and full.warmup_s == 120
    assert full.fallback == "off" and full.max_restarts == 50 and soak.parse_args([]).fallback is None
    assert [sig for _, sig in full.faults] == ["SIGKILL", "SIGSTOP"] * 2 + ["SIGKILL"]  # within max_restarts 5
    assert soak.parse_args(["--full", "--clients", "2", "--duration", "180"]).clients == 2  # given options win
    assert soak.parse_args(["--full", "--duration", "180"]).warmup_s == 30
    with pytest.raises(SystemExit):
        soak.parse_args(["--stop-at", "400", "--duration", "300"])


def test_soak_request_mix():
    """Without a mix the plans are the base ones (same draws); with one: closed streams never near
    max_model_len and always long enough to be closed mid-way, n > 1 only where sampled, greedy ones recorded."""
    import random

    soak = _soak()
    rng = random.Random(3)
    base = [soak.request_plan(rng, ["a", "b"]) for _ in range(50)]
    assert all(p["stream"] and p["n"] == 1 and not p["record"] and not p["long"] and p["cancel_after"] is None
               for p in base)
    again = random.Random(3)
    assert [soak.request_plan(again, ["a", "b"], mix={"stream_share": 1.0}) for _ in range(50)] == base

    class Long:
        def draw(self, rng):
            return "w5 " * 1000, 1000

    rng = random.Random(0)
    mix = {"stream_share": 0.7, "cancel_share": 0.3, "n_share": 0.5, "long_share": 0.2, "record": True,
           "word_stops": True}
    plans = [soak.request_plan(rng, ["w2 w3"], [0.0, 0.7, 1.0], mix, Long()) for _ in range(2000)]
    assert {True, False} == {p["stream"] for p in plans}
    cancelled = [p for p in plans if p["cancel_after"]]
    assert cancelled and all(p["stream"] and not p["long"] and p["extra"]["ignore_eos"] and "stop" not in p["body"]
                             and p["body"]["max_tokens"] == soak.LENGTHS[-1] for p in cancelled)
    assert all(p["body"]["temperature"] > 0 for p in plans if p["n"] > 1) and any(p["n"] > 1 for p in plans)
    assert all(p["record"] == (p["body"]["temperature"] == 0) for p in plans)
    assert any(p["long"] for p in plans) and all(p["prompt_len"] == 1000 for p in plans if p["long"])
    assert all(p["body"]["stop"] in soak.WORD_STOP_STRINGS for p in plans if "stop" in p["body"])


def test_soak_greedy_comparison():
    soak = _soak()
    start = 100.0

    def rec(prompt, out, cancelled=False, t=10.0):
        return {"start": start + t, "chat": False, "stream": True, "cancelled": cancelled, "long": False,
                "greedy": {"prompt_token_ids": prompt, "output_token_ids": out, "max_tokens": 8, "stop": None,
                           "stop_token_ids": None, "ignore_eos": True, "finish": "length"}}

    done = [rec([1, 2], [5, 6, 7]), rec([1, 2], [5, 6], cancelled=True), rec([3], [9, 9, 4], t=50.0),
            {"start": start, "chat": False}]  # a sampled request: not compared
    plain = {soak._replay_key(done[0]["greedy"], 64): {"token_ids": [5, 6, 7], "gaps": [0.5, 2.0, 1.0],
                                                       "finish": "length"},
             soak._replay_key(done[2]["greedy"], 64): {"token_ids": [9, 8, 4], "gaps": [3.0, 0.01, 1.0],
                                                       "finish": "length"}}
    got = soak.compare_greedy(done, plain, 64, [{"t": 40.0}], start)
    assert got["greedy_requests"] == 3 and got["compared"] == 3 and got["compared_as_prefix"] == 1
    assert got["mismatches"] == 1 and got["tokens_compared"] == 8 and got["least_top2_gap"] == 0.01
    miss = got["mismatch_samples"][0]
    assert (miss["first_diff_at"], miss["soak_token"], miss["plain_token"], miss["plain_top2_gap"]) == (1, 9, 8, 0.01)
    assert miss["near_fault"]
    # max_tokens past max_model_len is capped as the server caps it, so the replay asks what the server did
    assert json.loads(soak._replay_key(done[0]["greedy"], 6))[1] == 4


def test_soak_sigstop_recovery_trend_and_processes():
    soak = _soak()
    polls = [{"t": t, "state": st, "drafters": dr, "drafts": d, "restarts": r, "failures": f}
             for t, st, dr, d, r, f in [(9, "ready", [7], 10, 0, 0), (11, "ready", [7], 10, 0, 0),
                                        (12, "restarting", [7], 10, 1, 2), (13, "restarting", [], 10, 1, 3),
                                        (18, "ready", [8], 10, 1, 3), (19, "ready", [8], 14, 1, 3)]]
    dash = [{"t": 5, "samples": {'vllm:saguaro_drafter_failures_total{reason="timeout"}': 0.0}},
            {"t": 15, "samples": {'vllm:saguaro_drafter_failures_total{reason="timeout"}': 1.0,
                                  'vllm:saguaro_drafter_failures_total{reason="restarting"}': 2.0}}]
    got = soak.recovery(polls, {"t": 10.0, "pid": 7, "signal": "SIGSTOP"}, [], 0.0, dashboard=dash)
    assert got["signal"] == "SIGSTOP" and got["gone_after_s"] == 3 and got["ready_after_s"] == 8
    assert got["recovered_after_s"] == 9 and got["new_pid"] == 8 and got["restarts"] == 1
    assert got["failures_by_reason"] == {"restarting": 2.0, "timeout": 1.0}
    assert soak.trend_per_h([(0, 100), (1800, 100.5), (3600, 101)]) == 1.0
    assert soak.trend_per_h([(0, 1), (10, 2), (20, 3)]) is None  # too short a span to fit
    samples = [{"t": t, "procs": {"1": {"role": "worker", "mb": mb, "cpu_s": t / 2},
                                  **({"2": {"role": "drafter", "mb": 50.0, "cpu_s": 0.0}} if t >= 60 else {})}}
               for t, mb in [(0, 90.0), (30, 100.0), (60, 101.0), (90, 102.0)]]
    procs = soak.process_memory(samples, 30)
    assert procs["1"]["start_mb"] == 100.0 and procs["1"]["growth"] == 0.02 and procs["1"]["cores"] == 0.5
    assert procs["2"]["from_t_s"] == 60 and procs["2"]["alive_t_s"] == [60, 90]
    series = soak.time_series([{"t": t, "lookups": 2 * t, "hits": t, "generated": 10 * t, "requests": t}
                               for t in range(0, 61)], every_s=30)
    assert [(w["from_t_s"], w["to_t_s"], w["hit_rate"], w["tokens_per_s"]) for w in series] == [
        (0, 30, 0.5, 10.0), (30, 60, 0.5, 10.0)]


def test_soak_replacements_the_plugin_made_on_its_own():
    """A drafter that went away without a scheduled fault is listed with the plugin's log line and its last /proc
    samples, and is measured from its own ready time (not from the fault before it)."""
    soak = _soak()
    polls = [{"t": t, "state": st, "drafters": dr} for t, st, dr in [
        (1, "ready", [5]), (2, "ready", [5]), (3, "restarting", []), (9, "ready", [6]), (10, "restarting", []),
        (20, "ready", [7]), (30, "ready", [7])]]
    assert soak.ready_times(polls) == {5: 1, 6: 9, 7: 20}

    class Watch:
        history = {6: [(9.5, "R", 1.0, 9), (10.0, "R", 1.0, 12)]}

    log = ["(Worker pid=1) WARNING ... Saguaro: drafter (pid 6) did not answer step 3 within 1.00 s and is not "
           "computing: it is hung; restarting it in 1 s (restart 2 of 5); steps go on without drafts"]
    got = soak.unexpected_replacements(polls, [{"t": 2.5, "pid": 5, "signal": "SIGKILL"}], Watch(), log)
    assert got == [{"pid": 6, "last_seen_s": 9, "log": log[0], "last_samples": [[9.5, "R", 1.0, 9], [10.0, "R", 1.0, 12]]}]
    line = report.replacement_line(got[0])
    assert "is not computing: it is hung" in line and "state R, 0.00 CPU-seconds, 9-12 runnable tasks" in line
    samples = [{"t": t, "drafter_pid": pid, "mb": {"drafter": mb}} for t, pid, mb in [
        (1, 5, 900.0), (2, 5, 900.0), (15, 7, 200.0), (25, 7, 1000.0), (30, 7, 1001.0), (40, 7, 1002.0)]]
    d = soak.drafter_memory(samples, [{"at_s": 2.5, "ready_after_s": 6.5, "killed_pid": 5}], 0, 5,
                            soak.ready_times(polls))
    assert (d[1]["from_t_s"], d[1]["start_mb"], d[1]["growth"]) == (25, 1000.0, 0.002)  # its own ready at 20 s


def test_ratio_interval_separates_real_differences_from_noise():
    import random

    rng = random.Random(1)
    base = [10 + rng.gauss(0, 2) for _ in range(40)]
    faster = [1.3 * v + rng.gauss(0, 0.5) for v in base]  # paired: same prompts
    same = [v + rng.gauss(0, 2) for v in base]
    r, lo, hi = report.ratio_ci(faster, base)
    assert 1.25 < r < 1.35 and 1.0 < lo < r < hi
    r, lo, hi = report.ratio_ci(same, base)
    assert lo < 1.0 < hi
    assert report.ratio_ci([1.0], [1.0]) is None
    data = {"results": [
        {"engine": "saguaro-async", "batch": 1, "temperature": 0.7, "round": 0, "per_seq_tok_s": faster,
         "decode_tok_s_per_seq": 13},
        {"engine": "saguaro-sync", "batch": 1, "temperature": 0.7, "round": 0, "per_seq_tok_s": base,
         "decode_tok_s_per_seq": 10}]}
    lines = report.interval_table(data, {(1, 0.7): {}})
    assert any("SSD / `sync`" in ln and "SSD faster" in ln and "| 40 |" in ln for ln in lines)


def test_per_token_acceptance_from_vllm_position_counters():
    # 100 drafts of K=3 with an i.i.d. rate 0.5: 50 accept position 0, 25 position 1, 12.5 position 2
    assert run.per_token_acceptance(100, [50, 25, 12.5]) == 0.5
    assert run.per_token_acceptance(10, [10, 10, 10]) == 1.0
    assert run.per_token_acceptance(0, []) is None


def test_ceiling_and_verify_curve_sections():
    machine = {"cpu": "x", "cpus": 2}
    ceiling = {"_file": "c.json", "date": "2026-12-04T18:00:00", "machine": machine, "k": 5, "max_depth": 8,
               "num_prompts": 2, "max_tokens": 64, "rounds": 2, "placement": "p", "command": "c",
               "summary": {"oracle-k5": {"tok_s_per_seq": 20.0, "per_seq_tok_s": [20.0] * 4,
                                         "mean_acceptance_length": 6.0},
                           "saguaro-async-k5": {"tok_s_per_seq": 15.0, "per_seq_tok_s": [14.0, 16.0, 15.0, 15.0],
                                                "mean_acceptance_length": 4.5, "hit_rate": 1.0, "verify_ms": 180.0},
                           "saguaro-async-depth-auto-k8": {"tok_s_per_seq": 18.0,
                                                           "per_seq_tok_s": [17.0, 19.0, 18.0, 18.0],
                                                           "mean_acceptance_length": 5.5, "hit_rate": 0.9,
                                                           "verify_ms": 200.0}}}
    text = "\n".join(report.ceiling_section(ceiling))
    assert "depth auto / fixed K=5: 1.20x" in text and "bar >= 1.15x: met" in text
    assert "depth auto / the K=5 ceiling: 0.90x; bar > 1: missed" in text
    curve = {"_file": "v.json", "date": "2026-12-04T18:00:00", "machine": machine, "max_tokens": 64,
             "placement": "p", "command": "c",
             "points": [{"batch": 1, "depth": 0, "verify_ms": 150.0}, {"batch": 1, "depth": 5, "verify_ms": 180.0,
                                                                      "mean_acceptance_length": 4.0, "hit_rate": 1.0}]}
    text = "\n".join(report.verify_curve_section(curve))
    assert "| 1 | 5 | 180.0 | 1.20x | 4.00 |" in text and "| 1 | 0 | 150.0 | 1.00x |" in text


def test_oracle_proposer_returns_the_recorded_continuation(tmp_path, monkeypatch):
    import types

    import numpy as np

    path = tmp_path / "greedy.json"
    path.write_text(json.dumps([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 7, 6, 5]]))
    monkeypatch.setenv("SAGUARO_ORACLE_TOKENS", str(path))
    oracle = _load("oracle_proposer").OracleProposer(
        types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=3)))
    tokens = np.zeros((3, 10), dtype=np.int64)
    tokens[0, :4] = [1, 2, 3, 4]
    tokens[1, :3] = [9, 9, 8]
    tokens[2, :3] = [5, 5, 5]  # not a recorded prefix
    drafts = oracle.propose([[4], [8], [5]], np.array([4, 3, 3]), tokens)
    assert drafts == [[5, 6, 7], [7, 6, 5], []]
    assert oracle.propose([[]], np.array([4]), tokens[:1]) == [[]]  # a prefill chunk: nothing to draft


def test_real_vocab_and_host_overhead_sections():
    """The issue-26 table compares every Saguaro mode with `draft_model` per cell and lists the bars it missed,
    by how much; the host-overhead table shows the measured tree (`after`) where a result holds several."""
    machine = {"cpu": "test CPU", "cpus": 2}

    def row(engine, batch, t, step, **kw):
        return {"engine": engine, "vocab": 128256, "batch": batch, "temperature": t, "step_ms": step, **kw}

    data = {"_file": "x.json", "date": "2026-12-05T00:00", "commit": "abc", "model": "m", "k": 5, "max_tokens": 96,
            "prompt_len": 16, "placement": "p", "machine": machine, "command": "cmd", "results": [
                row("vllm-ar", 16, 0.0, 7.0), row("vllm-draft_model", 16, 0.0, 150.0),
                row("saguaro-sync", 16, 0.0, 140.0), row("saguaro-async", 16, 0.0, 165.0, ring_used_mb=10.0,
                                                         saguaro={"cache_lookups_total{depth=\"5\"}": 4.0,
                                                                  "cache_hits_total{depth=\"5\"}": 3.0})]}
    text = "\n".join(report.real_vocab_section(data))
    assert "| 128256 | 16 | 0 | 7.0 | 150.0 | 140.0 | 165.0 | 0.93x | 1.10x | 0.75 | 10 |" in text
    assert "Bars on this result: met in 1 of 2 " in text
    assert "Saguaro `sync` 140.0 ms per step" not in text  # a met bar is only counted
    assert "Saguaro `async` 165.0 ms per step against 150.0 (missed by 10 %)" in text
    host = [{"_file": "h.json", "label": "greedy", "date": "2026-12-05T00:00", "commit": "abc", "machine": machine,
             "command": "cmd", "results": [
                 {"temperature": 0.0, "vocab": 256, "batch": 64, "budget": 32, "tree": t, "answer_ms": a,
                  "glue_ms": 1.0, "branch_step_ms": b, "jit_ms": None, "transfers_per_forward": x}
                 for t, a, b, x in (("before", 2.0, 9.0, 400.0), ("after", 0.5, 1.5, 1.0))]}]
    text = "\n".join(report.host_overhead_section(host))
    assert "| 0 | 256 | 64 | 32 | after | 0.50 | 1.00 | 1.50 | - | 1.0 |" in text
    assert "| before |" not in text
    assert "[h.json](../benchmarks/results/h.json)" in text
    host[0]["results"][1]["tree"] = None  # a result of one tree: every row
    text = "\n".join(report.host_overhead_section(host))
    assert "| 0 | 256 | 64 | 32 | before | 2.00 | 1.00 | 9.00 | - | 400.0 |" in text
    host[0]["results"][1]["tree"] = "after"
    host[0]["results"][1].update(branch_step_host_ms=0.6, glue_host_ms=0.25)  # newer results split off the model
    text = "\n".join(report.host_overhead_section(host))
    assert "| 0 | 256 | 64 | 32 | after | 0.50 | 1.00 (0.25) | 1.50 (0.60) | - | 1.0 |" in text


# ------------------------------------------------------------------ benchmarks/bench_serve.py (vllm bench serve)

SERVE_FIXTURES = ROOT / "tests" / "fixtures" / "bench_serve"


def _bench_serve():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_serve.py imports run's helpers as `run`
    try:
        return _load("bench_serve")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _serve_fixture(name: str) -> tuple[dict, dict | None]:
    """A result JSON that a real `vllm bench serve` run wrote (and the server's /metrics delta over it)."""
    delta = SERVE_FIXTURES / f"{name}.metrics-delta.json"
    return (json.loads((SERVE_FIXTURES / f"{name}.json").read_text()),
            json.loads(delta.read_text()) if delta.exists() else None)


def test_bench_serve_rows_come_from_vllms_result_json_and_the_metrics_delta():
    bs = _bench_serve()
    result, delta = _serve_fixture("saguaro-async-corpus-t0-c4")
    row = bs.summary_row(result, delta)
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms",
                "output_throughput", "completed"):
        assert row[key] == result[key] and row[key] is not None
    assert row["failed"] == 0 and row["completed"] == result["num_prompts"]
    assert row["spec_decode_acceptance_rate"] == pytest.approx(result["spec_decode_acceptance_rate"] / 100)
    assert row["spec_decode_acceptance_length"] == result["spec_decode_acceptance_length"] > 1
    # SSD's hit rate: hits / lookups summed over the labelled samples of the server's /metrics page
    hits = sum(v for k, v in delta.items() if k.startswith("vllm:saguaro_cache_hits_total"))
    lookups = sum(v for k, v in delta.items() if k.startswith("vllm:saguaro_cache_lookups_total"))
    assert lookups > 0 and row["hit_rate"] == pytest.approx(hits / lookups)
    # the same counters read by this script and by vLLM's client agree
    assert row["metrics_acceptance_length"] == pytest.approx(row["spec_decode_acceptance_length"], rel=0.05)
    ar = bs.summary_row(*_serve_fixture("vllm-ar-corpus-t0-c4"))
    assert ar["spec_decode_acceptance_length"] is None and ar.get("hit_rate") is None and ar["p50_tpot_ms"] > 0
    assert bs.metrics_delta({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 2.0, "c": 1.0}) == {"a": 2.0, "c": 1.0}


def test_bench_serve_commands_are_valid_vllm_bench_serve_arguments(tmp_path):
    bs = _bench_serve()
    a = bs.parse_args(["--concurrency", "1,64", "--output-len", "64", "--requests-per-client", "1",
                       "--min-requests", "2"])
    assert [bs.num_requests(a, c) for c in a.concurrency] == [2, 64]
    cmd = bs.bench_command(a, "http://127.0.0.1:1", "/tok", "corpus", tmp_path / "c.jsonl", 0.7, 64, tmp_path,
                           "x.json", {"engine": "saguaro-async"})
    assert cmd[cmd.index("bench") + 1] == "serve"
    argv = cmd[cmd.index("serve") + 1:]
    for flag, value in (("--dataset-name", "custom"), ("--temperature", "0.7"), ("--max-concurrency", "64"),
                        ("--custom-output-len", "64"), ("--result-dir", str(tmp_path)), ("--num-prompts", "64")):
        assert argv[argv.index(flag) + 1] == value
    assert {"--save-result", "--ignore-eos", "--skip-chat-template"} <= set(argv)
    # the flags exist in this vLLM's `vllm bench serve` parser and mean what we want
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    assert (args.dataset_name, args.temperature, args.max_concurrency, args.save_result) == ("custom", 0.7, 64, True)
    assert args.metric_percentiles == "50,99" and "tpot" in args.percentile_metrics
    cmd = bs.bench_command(a, "u", "/tok", "random", None, 0.0, 1, tmp_path, "y.json", {})
    rnd = parser.parse_args(cmd[cmd.index("serve") + 1:])
    assert (rnd.dataset_name, rnd.random_output_len, rnd.temperature) == ("random", 64, 0.0)
    # placement as run.py: vLLM engines confined whole to the target's cores in `split`, Saguaro never
    assert run.engine_pin("vllm-draft_model-k5", "split", [0]) == [0]
    assert run.engine_pin("saguaro-async", "split", [0]) is None and run.engine_pin("vllm-ar", "equal", [0]) is None


def test_bench_serve_report_section_and_tpot_plot(tmp_path, monkeypatch):
    bs = _bench_serve()
    monkeypatch.setattr(report, "IMG", tmp_path / "img")
    runs = []
    for engine in ("vllm-ar", "saguaro-async"):
        result, delta = _serve_fixture(f"{engine}-corpus-t0-c4")
        for c in (1, 4):  # the same real result at two concurrencies: two points per line
            runs.append({"engine": engine, "dataset": "corpus", "temperature": 0.0, "concurrency": c,
                         "num_prompts": result["num_prompts"], "row": bs.summary_row(result, delta)})
    data = {"kind": "serve", "name": "serve-unit", "label": "unit", "date": "2026-12-06T00:00:00+00:00",
            "_file": "2026-12-06-serve-unit.json", "command": "benchmarks/bench_serve.py", "note": "noisy",
            "machine": {"cpu": "x", "cpus": 2}, "load_avg": {"start": [3.0], "end": [4.0]}, "target": "/t",
            "draft": "/d", "result_dir": "benchmarks/results/serve/x", "runtime_s": 600,
            "placement": {"mode": "split", "rule": "r"},
            "settings": {"k": 5, "concurrency": [1, 4], "datasets": ["corpus"], "temperatures": [0.0],
                         "output_len": 16, "random_input_len": 128, "requests": {"1": 4, "4": 4},
                         "corpus_prompts": 32, "client": "cli"}, "runs": runs, "summary": bs.merge(runs)}
    assert set(data["summary"]) == {"corpus|T0|c1", "corpus|T0|c4"}
    text = "\n".join(report.serve_section(data))
    ssd = runs[-1]["row"]
    tput = ssd["output_throughput"] / runs[1]["row"]["output_throughput"]
    assert (f"| corpus | 0 | 4 | Saguaro `async` (SSD) | {ssd['p50_ttft_ms']:.0f} / {ssd['p99_ttft_ms']:.0f} | "
            f"{ssd['p50_tpot_ms']:.0f} / {ssd['p99_tpot_ms']:.0f} "
            f"| {ssd['output_throughput']:.1f} | {tput:.2f}x | {ssd['spec_decode_acceptance_rate']:.2f} "
            f"| {ssd['spec_decode_acceptance_length']:.2f} | {ssd['hit_rate']:.3f} | - |") in text
    assert "| corpus | 0 | 1 | vLLM AR |" in text and "Failed requests: 0 of 16" in text and "noisy" in text
    assert (tmp_path / "img" / "serve-unit-tpot.png").stat().st_size > 1000 and "img/serve-unit-tpot.png" in text

    # --extend: a later run of another case joins the result; a run of the same cell replaces the old one
    later = [dict(r, dataset="random", temperature=0.7) for r in runs[:2]] + [dict(runs[3], num_prompts=99)]
    new = data | {"date": "2026-12-06T05:00:00+00:00", "command": "benchmarks/bench_serve.py --cases random:0.7",
                  "load_avg": {"start": [1.5], "end": [1.0]}, "runtime_s": 60, "note": "",
                  "settings": data["settings"] | {"cases": ["random:0.7", "corpus:0"], "datasets": ["random", "corpus"],
                                                  "temperatures": [0.7, 0.0]},
                  "runs": later, "summary": bs.merge(later)}
    data["settings"]["cases"] = ["corpus:0"]
    both = bs.extend_result(data, new)
    assert set(both["summary"]) == {"corpus|T0|c1", "corpus|T0|c4", "random|T0.7|c1", "random|T0.7|c4"}
    replaced = [r["num_prompts"] for r in both["runs"] if (r["engine"], r["dataset"], r["concurrency"]) ==
                ("saguaro-async", "corpus", 4)]
    assert len(both["runs"]) == 6 and replaced == [99]
    assert both["settings"]["cases"] == ["corpus:0", "random:0.7"] and both["settings"]["datasets"] == ["corpus", "random"]
    assert "| random | 0.7 | 4 | vLLM AR |" in "\n".join(report.serve_section(both))
    assert "added later (2026-12-06 05:00 UTC, load average 1.5" in "\n".join(report.serve_section(both))
    with pytest.raises(SystemExit, match="setting output_len differs"):
        bs.extend_result(data, new | {"settings": new["settings"] | {"output_len": 32}})


def test_validation_section_shows_the_crossover_and_where_the_calibration_came_from():
    """The projection's validation: AR measured against projected, whether AR is ahead of each Saguaro mode
    in the runs and in the projection (`ar_row`: the crossover must agree), and which runs calibrated it."""
    validate = _load("validate_projection")
    projection = _load("report_projection")
    from saguaro_vllm.drafter.predictor import StepCostModel
    from saguaro_vllm.projection.cost_model import CostModel

    cost = CostModel({4: {1.0: 0.05, 6.0: 0.1}}, StepCostModel(0.001, 0.0), {}, {})
    rows = [{"mode": "sync", "batch": 4, "temperature": 0.0, "engine_run": {"decode_tok_s_per_seq": 25.0},
             "projected": {"per_seq_tokens_per_s": 30.0, "per_request_tokens_per_s": 18.0}},
            {"mode": "async", "batch": 4, "temperature": 0.0, "engine_run": {"decode_tok_s_per_seq": 15.0},
             "projected": {"per_seq_tokens_per_s": 12.0, "per_request_tokens_per_s": 21.0}},
            {"mode": "async", "batch": 4, "temperature": 1.0, "engine_run": {"decode_tok_s_per_seq": 1.0},
             "projected": {"per_seq_tokens_per_s": 1.0, "per_request_tokens_per_s": 1.0}}]
    x = validate.ar_row({"batch": 4, "decode_tok_s_per_seq": 19.0}, cost, rows)
    assert x["projected_per_seq"] == pytest.approx(20.0) and x["error"] == pytest.approx(20 / 19 - 1, abs=1e-4)
    # each mode's projection per request (its own span), not the batch's total over its size
    assert x["ahead_of"] == {"sync": {"measured": False, "projected": True, "measured_per_seq": 25.0,
                                      "projected_per_seq": 18.0},
                             "async": {"measured": True, "projected": False, "measured_per_seq": 15.0,
                                       "projected_per_seq": 21.0}}
    assert not x["agrees"]
    cell = {"mode": "sync", "batch": 4, "temperature": 0.0, "measured": {"tokens_per_s": 90.0},
            "projected": {"tokens_per_s": 92.0}, "tokens_error": 0.022, "within_bars": True}
    data = {"_file": "v.json", "cells": [cell], "vllm_ar": [x], "calibrated_from": "calibration runs on other prompts",
            "calibration": [{"mode": "sync", "batch": 4, "temperature": 0.0}]}
    text = "\n".join(projection.validation_lines(data))
    assert "1 of 1 cells within the bars" in text and "other prompts (sync b4 T=0)" in text
    assert "| 4 | 19.00 | 20.00 | +5.3 % | no / yes (25.00 / 18.00) | yes / no (15.00 / 21.00) |" in text


def test_repeatability_measures_each_run_like_the_validation_and_spreads_them():
    """`repeatability.py` over two stored validations' trace directories (tests/fixtures/traces: the sync
    cells and the SSD cells at batch 1 of each, 12 of their 18 cells): each run measured as its validation
    measured it, the spread per cell, and the page's table."""
    repeat = _load("repeatability")
    projection = _load("report_projection")
    traces = ROOT / "tests" / "fixtures" / "traces"
    results = ROOT / "benchmarks" / "results"
    roots = [traces / "2026-12-06-demo-pair-b1b4b16-256-covfloor", traces / "2026-12-07-demo-pair-b1b4b16-256"]
    validations = [json.loads((results / name).read_text())["cells"] for name in
                   ("2026-12-06-validate-projection-b1b4b16-256-covfloor.json",
                    "2026-12-07-validate-projection-b1b4b16-256-heldout.json")]
    cells = repeat.cells(roots)
    assert len(cells) == 12 and all(c["runs"] == 2 for c in cells)
    for c in cells:
        key = (c["mode"], c["batch"], c["temperature"])
        for run, validated in zip(c["measured"], validations, strict=True):
            v = next(x for x in validated if (x["mode"], x["batch"], x["temperature"]) == key)
            assert run["tokens_per_s"] == pytest.approx(v["measured"]["tokens_per_s"])
            assert run["hit_rate"] == v["measured"].get("hit_rate")
    sync_b4 = next(c for c in cells if (c["mode"], c["batch"], c["temperature"]) == ("sync", 4, 0.7))
    assert sync_b4["tokens_spread"] == pytest.approx(28.95 / 23.42 - 1, abs=1e-3) and not sync_b4["within_bars"]
    assert "hit_rate_range" not in sync_b4
    ssd_b1 = next(c for c in cells if (c["mode"], c["batch"], c["temperature"]) == ("async", 1, 0.0))
    assert ssd_b1["within_bars"] and ssd_b1["hit_rate_range"] < 0.01
    assert repeat.spread([{"tokens_per_s": 10.0, "hit_rate": 0.5}, {"tokens_per_s": 10.5, "hit_rate": 0.58}]) == {
        "runs": 2, "tokens_per_s_mean": 10.25, "tokens_spread": 0.05, "hit_rate_mean": 0.54,
        "hit_rate_range": 0.08, "within_bars": False}
    text = "\n".join(projection.repeatability_lines({"_file": "r.json", "cells": cells}))
    assert "| sync | 4 | 0.7 | 2 | 28.95, 23.42 | +23.6 % | - | - | no | - |" in text
    assert f"{sum(c['within_bars'] for c in cells)} of 12 cells repeat within the bars." in text
    # a validation's projection against the mean of each cell's runs
    versus = repeat.against_validation(cells, {"_file": "v.json", "cells": validations[1]})
    ssd_b1 = next(c for c in cells if (c["mode"], c["batch"], c["temperature"]) == ("async", 1, 0.0))
    v = next(x for x in validations[1] if (x["mode"], x["batch"], x["temperature"]) == ("async", 1, 0.0))
    assert ssd_b1["projected"]["error_vs_mean"] == pytest.approx(
        v["projected"]["tokens_per_s"] / ((29.18 + 29.75) / 2) - 1, abs=2e-3)
    assert ssd_b1["projected"]["hit_rate_error_vs_mean"] == pytest.approx(v["projected"]["hit_rate"] - 0.9646, abs=1e-3)
    assert versus["cells"] == 12 and versus["within_bars"] == sum(c["projected"]["within_bars"] for c in cells)
    text = "\n".join(projection.repeatability_lines({"_file": "r.json", "cells": cells, "against_validation": versus}))
    assert (f"the projection of [v.json](../benchmarks/results/v.json) is within the bars in "
            f"{versus['within_bars']} of 12 cells") in text
