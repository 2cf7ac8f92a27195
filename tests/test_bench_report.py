"""The benchmark harness without engines: cases are data, runs interleave engines within each round, the
report picks draft_model's best K, checks the bars and draws its plots."""
from __future__ import annotations

import importlib.util
import json
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
    monkeypatch.setattr(report, "NOTES", tmp_path / "none.md")
    results = []
    for b in (1, 4):
        for t in (0.0, 1.0):
            results += [_result("vllm-ar", b, t, 6.0), _result("vllm-draft_model-k3", b, t, 11.0),
                        _result("vllm-draft_model-k5", b, t, 12.0), _result("saguaro-sync", b, t, 12.5),
                        _result("saguaro-async", b, t, 17.0 if t == 0 else 12.0, hit_rate=0.9 if t == 0 else 0.5,
                                predraft_ms=150.0, verify_ms=180.0)]
    data = {"name": "unit", "date": "2026-12-02T00:00:00", "command": "run.py", "models": "cost",
            "target": "/t", "draft": "/d", "num_prompts": 1, "max_tokens": 8, "rounds": 1, "k": 5,
            "k_draft_model": "3,5", "machine": {"cpu": "x", "cpus": 2, "memory_gb": 24, "platform": "linux",
                                                "versions": {"vllm": "0.32.0"}},
            "placement": {"mode": "split", "rule": "r", "target_cores": "0", "draft_cores": "1"},
            "results": results}
    page = report.render([data])
    assert "| 1 | 0 | vLLM `draft_model` K=5 | 12.00 |" in page  # the best K is shown
    assert "SSD >= 1.5x vLLM `draft_model` (batch 1, T=0): 1.42x, **not met**" in page
    assert "SSD >= 1.3x Saguaro `sync` (batch 1, T=0): 1.36x, met" in page
    assert "hit rate >= 0.6 at T=1 (batch 1): 0.500, **not met**" in page
    assert "worst 0.960x" in page
    for img in ("unit-throughput.png", "unit-speedup.png", "unit-temperature.png"):
        assert (tmp_path / "img" / img).stat().st_size > 1000 and f"img/{img}" in page


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
    got = soak.memory_growth(events, warmup_s=30, kill={"at_s": 70, "ready_after_s": 15})
    # worker: from its warm-up sample (t=30); drafter: the replacement's first sample >= 85 + 30 s (t=120)
    assert got["from"] == {"drafter": 120, "worker": 30}
    assert got["growth"] == {"drafter": round(20 / 1100, 4), "worker": round(38 / 1010, 4)} and got["ok"]
    assert got["second_half_growth"]["drafter"] == round(10 / 1110, 4)  # midpoint 150 s
    assert "replacement drafter" in got["notes"]["drafter"] and len(got["samples"]) == 7
    leaking = {**events, "memory_end": sample(180, 2, 1120, 1200)}
    leaking["memory_samples"] = [*samples, leaking["memory_end"]]
    assert not soak.memory_growth(leaking, 30, {"at_s": 70, "ready_after_s": 15})["ok"]


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
    """The issue-26 table compares every Saguaro mode with `draft_model` per cell and says met or by how much
    it missed; the host-overhead table lists every tree's row."""
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
    assert "Saguaro `sync` 140.0 ms per step against 150.0 (met)" in text
    assert "Saguaro `async` 165.0 ms per step against 150.0 (missed by 10 %)" in text
    host = [{"_file": "h.json", "label": "greedy", "date": "2026-12-05T00:00", "commit": "abc", "machine": machine,
             "command": "cmd", "results": [
                 {"temperature": 0.0, "vocab": 256, "batch": 64, "budget": 32, "tree": t, "answer_ms": a,
                  "glue_ms": 1.0, "branch_step_ms": b, "jit_ms": None, "transfers_per_forward": x}
                 for t, a, b, x in (("before", 2.0, 9.0, 400.0), ("after", 0.5, 1.5, 1.0))]}]
    text = "\n".join(report.host_overhead_section(host))
    assert "| 0 | 256 | 64 | 32 | after | 0.50 | 1.00 | 1.50 | - | 1.0 |" in text
    assert "| 0 | 256 | 64 | 32 | before | 2.00 | 1.00 | 9.00 | - | 400.0 |" in text
