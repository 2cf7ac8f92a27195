"""The GPU check (benchmarks/device_check.sh + device_check.py) kept from rotting where no GPU is: its
`--cpu-smoke` run end to end, its per-part timeout, its pytest parsing and its section of the benchmarks page."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_check  # noqa: E402


def test_shell_wrapper_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "device_check.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cpu_smoke_runs_every_part_it_can_and_names_the_rest(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_check.py"), "--cpu-smoke", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "device-check-cpu-smoke.json").read_text())
    parts = data["parts"]
    assert data["verdict"] == "yes" and data["mode"] == "cpu-smoke"
    assert set(parts) == {"environment", "nvcc", "build_ops", "rounds", "rounds_graphs", "op_tests",
                          "triton_attention", "device_ring"}
    assert parts["environment"]["result"]["present"]["pytest"] is True
    assert parts["build_ops"]["status"] == "yes" and "attention=cpp" in parts["build_ops"]["result"]["summary"]["cpu"]
    configs = parts["rounds"]["result"]["configs"]
    assert [(r["batch"], r["budget"]) for r in configs] == [(1, 8), (4, 8)]
    for r in configs:
        assert r["hits"] == r["batch"] and r["jit_misses"] == r["batch"] and r["branch_steps"] > 0, r
        assert r["graph_mode"] == "dynamic" and r["transfers_per_forward"] >= 0 and sum(r["fanout"]) > 0, r
    graphs = parts["rounds_graphs"]
    if graphs["status"] == "yes":  # the drafter has the CUDA-graph option: on CPU its static path, no capture
        assert all(r["graph_mode"] == "static" and r["static_runs"] > 0 for r in graphs["result"]["configs"])
    else:
        assert graphs["status"] == "not run" and "no CUDA-graph option" in graphs["reason"]
    for name, p in parts.items():
        assert p["status"] != "no", (name, p)
        if p["status"] == "not run":
            assert p["reason"], name
    for line in ("=== device check: YES", "NOT RUN nvcc: --cpu-smoke", "graphs=off (dynamic) batch  4 budget  8: glue"):
        assert line in proc.stdout, line
    assert (tmp_path / "device-check-cpu-smoke.log").read_text().count("=====") >= 2


def test_a_part_past_its_timeout_is_killed_and_the_next_still_runs(tmp_path):
    args = argparse.Namespace(cpu_smoke=True, budget_s=60.0, out=str(tmp_path))
    driver = device_check.Driver(args)
    parts = [device_check.Part("slow", 2, [sys.executable, "-c", "import time; time.sleep(60)"], parse="pytest"),
             device_check.Part("fails", 30, [sys.executable, "-m", "pytest", "-q", "--co", "/nonexistent/x.py"],
                               parse="pytest"),
             device_check.Part("skipped", 30, ["true"], skip="needs CUDA"),
             device_check.Part("environment", 60, [sys.executable, str(ROOT / "benchmarks" / "device_check.py"),
                                                   "--part", "environment"])]
    assert driver.run(parts) == 1
    data = json.loads(driver.json_path.read_text())["parts"]
    assert data["slow"]["status"] == "no" and "timed out" in data["slow"]["reason"] and data["slow"]["seconds"] < 20
    assert data["fails"]["status"] == "no" and data["skipped"] == {"status": "not run", "reason": "needs CUDA"}
    assert data["environment"]["status"] == "yes" and data["environment"]["result"]["torch"]


def test_pytest_counts_and_skip_reasons():
    text = ("SKIPPED [2] tests/test_vllm_attention.py:157: vllm is not installed\n"
            "SKIPPED [1] tests/test_x.py:3: needs a CUDA device\n"
            "12 passed, 1 failed, 3 skipped, 4 deselected in 9.1s\n")
    counts = device_check.pytest_counts(text)
    assert counts["passed"] == 12 and counts["failed"] == 1 and counts["skipped"] == 3 and counts["deselected"] == 4
    assert counts["skip_reasons"] == ["needs a CUDA device", "vllm is not installed"]


def test_benchmarks_page_section(tmp_path):
    lines = device_check.report_lines(tmp_path)
    assert any("Not run yet" in line for line in lines)
    (tmp_path / "2026-12-05-device-check-cpu-smoke.json").write_text(json.dumps({"mode": "cpu-smoke"}))
    assert any("Not run yet" in line for line in device_check.report_lines(tmp_path))  # smoke runs are not GPU results
    row = {"batch": 64, "budget": 32, "cuda_graphs": True, "graph_mode": "cuda-graphs", "glue_ms": 9.1,
           "branch_step_ms": 2.5, "jit_ms": 2.0, "answer_ms": 0.8, "hits": 64, "jit_misses": 64,
           "transfers_per_forward": 1.0, "fanout": [8, 4, 2, 1, 1, 16], "attention": "cuda-decode+reference"}
    gpu = {"mode": "gpu", "verdict": "no", "elapsed_s": 400,
           "parts": {"environment": {"status": "yes", "result": {"torch": "2.11.0", "gpu": {"name": "NVIDIA H100"}}},
                     "rounds_graphs": {"status": "yes", "result": {"configs": [row]}},
                     "device_ring": {"status": "not run", "reason": "timed out"}}}
    (tmp_path / "2026-12-06-device-check.json").write_text(json.dumps(gpu))
    text = "\n".join(device_check.report_lines(tmp_path))
    assert "verdict **NO**, NVIDIA H100" in text and "| device_ring | not run | timed out |" in text
    assert "| cuda-graphs | 64 | 32 | 9.1 | 2.5 | 2.0 | 0.8 | 64 | 64 | 1.0 |" in text


def test_report_page_includes_the_section(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_report_dc", ROOT / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    monkeypatch.setattr(report, "NOTES", tmp_path / "none.md")
    assert "## GPU device check" in report.render([]) and "Not run yet" in report.render([])


def test_gpu_plan_names_why_parts_cannot_run():
    args = argparse.Namespace(cpu_smoke=False)
    bare = {p.name: p.skip for p in device_check.plan(args, cuda=False, nvcc=False)}
    assert bare["environment"] is None and bare["nvcc"] == "nvcc is not on PATH"
    for name in ("build_ops", "rounds", "rounds_graphs", "op_tests", "triton_attention", "device_ring"):
        assert bare[name].startswith("no CUDA device"), name
    gpu = device_check.plan(args, cuda=True, nvcc=True)
    assert all(p.skip is None for p in gpu)  # pytest is installed here, as on the GPU image
    assert sum(p.timeout_s for p in gpu if p.background) <= 450 and [p.name for p in gpu if p.background] == ["nvcc"]
    rounds = {p.name: p.argv for p in gpu}
    assert rounds["rounds_graphs"][-2:] == ["rounds", "--graphs"] and "--cpu-smoke" not in rounds["rounds"]
