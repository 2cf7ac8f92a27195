"""The GPU check that says yes or no (issue 28 item 7): one prepared run, under 8 minutes on one H100/H200,
with Python 3.12, torch (CUDA), Triton and nvcc alone (no vLLM, pyzmq, msgspec or pydantic needed).

Parts, each in its own process with its own timeout inside one overall budget (a failing or timed-out part
does not stop the others; the JSON is rewritten after each part, so a killed run still leaves one):

- `environment`: versions, the GPU, which optional packages are present;
- `nvcc` (in the background from the start): every CUDA source compiled with nvcc (tests/test_ops_build.py);
- `build_ops`: the saguaro ops built (CPU + CUDA) and loaded; `loader.summary()` per device;
- `rounds` / `rounds_graphs`: `SSDDrafter` rounds on a random Llama-3.2-1B-shaped bf16 draft at batch 1, 16
  and 64 with fan-out budgets 8 and 32, without and with CUDA graphs (tests/device_rounds.py): glue,
  branch-step, jit and answer times, hits, jit misses, transfers per forward, the planner's fan-out, and
  which attention ran (with why vLLM's kernels did not, where they did not);
- `op_tests`: the op tests on CUDA (and CPU); `triton_attention`: the project's Triton branch attention
  against the CUDA op and the reference; `device_ring`: benchmarks/check_device_ring.py.

At the end it prints YES / NO / NOT RUN per part, naming why each part not run was not run, and writes one
JSON (`$OUT/device-check.json`, else `benchmarks/results/<date>-device-check.json`) that benchmarks/report.py
renders. `--cpu-smoke`: tiny shapes on the CPU in seconds (tests/test_device_check.py), so the script cannot
rot where no GPU is.

    bash benchmarks/device_check.sh                  # the GPU check (exit 0: every part that ran said yes)
    python benchmarks/device_check.py --cpu-smoke --out /tmp/dc
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
YES, NO, NOT_RUN = "yes", "no", "not run"
OPTIONAL = ("vllm", "zmq", "msgspec", "pydantic", "pytest", "triton")
OP_TESTS = ["tests/test_ops_branch_attention.py", "tests/test_ops_candidates.py", "tests/test_ops_proposal.py",
            "tests/test_ops_triton.py", "tests/test_vllm_attention.py", "tests/test_ops_build.py"]
NVCC_TESTS = "compiles_with_toolkit_only or compile_as_built"


@dataclass
class Part:
    name: str
    timeout_s: float
    argv: list[str]  # the command, run from the repository root
    background: bool = False
    skip: str | None = None  # why it is not run
    parse: str = "json"  # "json": the part writes its result file; "pytest": counts from the output
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log: Path | None = None
    started: float = 0.0
    limit: float = 0.0


# ---- the parts run in their own processes (`--part NAME`) ----------------------------------------------------
def part_environment(args) -> tuple[str, str | None, dict]:
    import torch

    res = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           "present": {name: importlib.util.find_spec(name) is not None for name in OPTIONAL}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        res["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                      "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count}
    if res["present"]["triton"]:
        import triton

        res["triton"] = triton.__version__
    try:
        res["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.strip().splitlines()[-1]
    except (OSError, subprocess.SubprocessError, IndexError):
        res["nvcc"] = None
    return YES, None, res


def part_build_ops(args) -> tuple[str, str | None, dict]:
    from saguaro_vllm.ops import loader

    st = loader.status()
    device = "cpu" if args.cpu_smoke else "cuda"
    res = {"policy": st.policy, "library": st.library, "build_seconds": st.build_seconds, "with_cuda": st.with_cuda,
           "cuda_arch": st.cuda_arch, "cuda_error": st.cuda_error, "error": st.error,
           "summary": {dev: loader.summary(dev) for dev in ("cpu", "cuda")}}
    want = "cpp" if args.cpu_smoke else "cuda"
    got = loader.implementation(device)
    if got != want:
        return NO, f"{device} ops run {got}, expected {want}: {st.cuda_error or st.error}", res
    return YES, None, res


def part_rounds(args) -> tuple[str, str | None, dict]:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import device_rounds

    from saguaro_vllm.drafter import vllm_attention
    from saguaro_vllm.ops import loader

    graphs = args.graphs
    device, dtype = ("cpu", torch.float32) if args.cpu_smoke else ("cuda", torch.bfloat16)
    shape = "smoke" if args.cpu_smoke else "llama-3.2-1b"
    batches, budgets = ((1, 4), (8,)) if args.cpu_smoke else ((1, 16, 64), (8, 32))
    rounds, blocks = (2, 512) if args.cpu_smoke else (4, 8192)
    t0 = time.perf_counter()
    model = device_rounds.make_model(shape, dtype, device)
    res = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "device": device, "k": device_rounds.K,
           "model_build_s": round(time.perf_counter() - t0, 2),
           "ops": loader.summary(device), "configs": []}
    failures = []
    for budget in budgets:
        for batch in batches:
            try:
                row = device_rounds.run_config(model, batch, budget, rounds=rounds, cuda_graphs=graphs,
                                               num_blocks=blocks)
            except Exception as exc:  # one configuration failing does not hide the others
                row = {"batch": batch, "budget": budget, "error": f"{type(exc).__name__}: {exc}"}
                failures.append(f"batch {batch} budget {budget}: {row['error']}")
            else:
                if not (row["hits"] and row["jit_misses"] and row["branch_steps"]):
                    failures.append(f"batch {batch} budget {budget}: no hits, jit misses or branch steps")
            print(json.dumps(row), flush=True)
            res["configs"].append(row)
    res["attention"] = next((r["attention"] for r in res["configs"] if "attention" in r), None)
    res["vllm_unavailable"] = (vllm_attention.unavailable_reason() if device == "cuda"
                               else "not tried: the drafter uses vLLM's kernels on CUDA only")
    ran = [r for r in res["configs"] if "error" not in r]
    if graphs and any(not r["static_runs"] for r in ran):
        failures.append("the static decode path took no forward")
    if failures:
        return NO, "; ".join(failures), res
    modes = sorted({r["graph_mode"] for r in ran})
    if graphs and device == "cuda" and modes != ["cuda-graphs"]:
        return NOT_RUN, (f"CUDA graphs were not captured: one-token forwards ran {'/'.join(modes)} (capture needs "
                         f"vLLM's FlashAttention or Triton attention; {res['attention']} ran here: "
                         f"{res['vllm_unavailable']}); those rounds are recorded"), res
    return YES, None, res


def part_triton_attention(args) -> tuple[str, str | None, dict]:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from test_ops_branch_attention import make_case

    from saguaro_vllm.ops import branch_attention, reference
    from saguaro_vllm.ops.triton_attention import branch_attention as triton_attention

    case = make_case(16, 24, [1000, 257], 16, 5, 32, 8, 64, torch.bfloat16, "cuda", seed=0)
    ref = reference.branch_attention(**case).float()
    res, bad = {"case": "bf16, batch 16 x 24 branches, prefix 1000, 32/8 heads, head 64"}, []
    for name, fn in (("cuda_op", branch_attention), ("triton", triton_attention)):
        out = fn(**case).float()
        err = ((out - ref).abs() / (1 + ref.abs())).max().item()
        for _ in range(3):
            fn(**case)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn(**case)
        torch.cuda.synchronize()
        res[name] = {"ms": round(1e3 * (time.perf_counter() - t) / 20, 4), "max_rel_err": err}
        if not err < 2e-2:
            bad.append(f"{name} max rel err {err:.2e}")
    return (NO, "; ".join(bad), res) if bad else (YES, None, res)


PART_FUNCS = {"environment": part_environment, "build_ops": part_build_ops, "rounds": part_rounds,
              "triton_attention": part_triton_attention}


def run_part_here(args) -> int:
    """`--part NAME --result FILE`: run one part in this process, write (status, reason, result)."""
    try:
        status, reason, res = PART_FUNCS[args.part](args)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        status, reason, res = NO, f"{type(exc).__name__}: {exc}", {}
    Path(args.result).write_text(json.dumps({"status": status, "reason": reason, "result": res}, default=str))
    return 0


# ---- the driver ------------------------------------------------------------------------------------------------
def plan(args, cuda: bool, nvcc: bool) -> list[Part]:
    me = [sys.executable, str(Path(__file__).resolve())] + (["--cpu-smoke"] if args.cpu_smoke else [])
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    no_cuda = None if cuda else "no CUDA device (torch.cuda.is_available() is False)"
    no_pytest = None if importlib.util.find_spec("pytest") else "pytest is not installed (carry a wheel in .whl/)"
    smoke = "--cpu-smoke: the CPU suite runs these" if args.cpu_smoke else None
    parts = [
        Part("environment", 60, me + ["--part", "environment"]),
        Part("nvcc", 240, pytest + ["tests/test_ops_build.py", "-k", NVCC_TESTS], background=True, parse="pytest",
             skip=smoke or ("nvcc is not on PATH" if not nvcc else None) or no_pytest),
        Part("build_ops", 240, me + ["--part", "build_ops"], skip=None if args.cpu_smoke else no_cuda),
        Part("rounds", 150, me + ["--part", "rounds"], skip=None if args.cpu_smoke else no_cuda),
        Part("rounds_graphs", 150, me + ["--part", "rounds", "--graphs"], skip=None if args.cpu_smoke else no_cuda),
        Part("op_tests", 150, pytest + OP_TESTS + ["-k", f"not ({NVCC_TESTS})"], parse="pytest",
             skip=smoke or no_cuda or no_pytest),
        Part("triton_attention", 60, me + ["--part", "triton_attention"], skip=smoke or no_cuda),
        Part("device_ring", 60, [sys.executable, "benchmarks/check_device_ring.py", "--rows", "64", "--k", "5",
                                 "--vocab", "128256", "--out", "{tmp}/ring.json"], skip=smoke or no_cuda),
    ]
    return parts


def pytest_counts(text: str) -> dict:
    """Counts of pytest's closing line, and the reasons of skipped tests (`-rs`)."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text)}
    counts["skip_reasons"] = sorted({m.strip() for m in re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", text, re.M)})
    return counts


class Driver:
    def __init__(self, args):
        self.args = args
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.tmp = Path(tempfile.mkdtemp(prefix="device-check-"))
        out = args.out or os.environ.get("OUT")
        date = datetime.datetime.now(datetime.UTC)
        self.out_dir = Path(out) if out else RESULTS
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = "device-check" + ("-cpu-smoke" if args.cpu_smoke else "")
        self.json_path = self.out_dir / (f"{name}.json" if out else f"{date:%Y-%m-%d}-{name}.json")
        self.log_path = self.json_path.with_suffix(".log")
        self.log_path.write_text("")
        self.report = {"name": name, "kind": "device-check", "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
                       "date": date.isoformat(), "command": " ".join(sys.argv), "budget_s": args.budget_s,
                       "verdict": "incomplete", "parts": {}}

    def launch(self, part: Part, timeout: float) -> None:
        argv = [a.replace("{tmp}", str(self.tmp)) for a in part.argv]
        if part.parse == "json" and "--part" in argv:
            argv += ["--result", str(self.tmp / f"{part.name}.json")]
        part.log = self.tmp / f"{part.name}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "PYTHONUNBUFFERED": "1"}
        if self.args.cpu_smoke:
            env["OMP_NUM_THREADS"] = "1"
        part.started, part.limit = time.monotonic(), timeout
        with open(part.log, "w") as log:
            part.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def finish(self, part: Part) -> dict:
        """Wait for `part` within its limit (killing its process group past it) and record its outcome."""
        try:
            rc = part.proc.wait(timeout=max(1.0, part.started + part.limit - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(part.proc.pid, signal.SIGKILL)
            rc, timed_out = part.proc.wait(), True
        text = part.log.read_text(errors="replace")
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {part.name} (rc {rc}) =====\n{text}")
        entry = {"seconds": round(time.monotonic() - part.started, 1), "rc": rc, "timeout_s": round(part.limit)}
        if timed_out:
            entry.update(status=NO, reason=f"timed out after {part.limit:.0f} s")
        elif part.parse == "pytest":
            counts = pytest_counts(text)
            entry.update(result=counts, status=YES if rc == 0 else NOT_RUN if rc == 5 else NO,
                         reason=None if rc == 0 else "no tests collected" if rc == 5 else f"pytest exit {rc}")
        elif part.name == "device_ring":
            path = self.tmp / "ring.json"
            entry.update(status=YES if rc == 0 else NO, reason=None if rc == 0 else f"exit {rc}",
                         result=json.loads(path.read_text()) if path.exists() else {})
        else:
            path = self.tmp / f"{part.name}.json"
            if path.exists():
                entry.update(json.loads(path.read_text()))
            else:
                entry.update(status=NO, reason=f"exit {rc} without a result")
        if entry["status"] != YES:
            entry["log_tail"] = text[-3000:]
        print(f"--- {part.name}: {entry['status'].upper()} in {entry['seconds']} s"
              + (f" ({entry['reason']})" if entry.get("reason") else ""), flush=True)
        print("\n".join(text.rstrip().splitlines()[-12:]), flush=True)
        return entry

    def record(self, name: str, entry: dict) -> None:
        self.report["parts"][name] = entry
        self.save()

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.start, 1)
        self.json_path.write_text(json.dumps(self.report, indent=1, default=str) + "\n")

    def run(self, parts: list[Part]) -> int:
        for part in parts:  # the background parts start first
            if part.background and part.skip is None:
                self.launch(part, part.timeout_s)
        for part in parts:
            if part.skip is not None:
                self.record(part.name, {"status": NOT_RUN, "reason": part.skip})
                continue
            if part.background:
                continue
            left = self.deadline - time.monotonic()
            if left < 15:
                self.record(part.name, {"status": NOT_RUN, "reason": f"out of time: {left:.0f} s of the "
                                        f"{self.args.budget_s:.0f} s budget left"})
                continue
            print(f"=== {part.name} (at {time.monotonic() - self.start:.0f} s, limit "
                  f"{min(part.timeout_s, left):.0f} s)", flush=True)
            self.launch(part, min(part.timeout_s, left))
            self.record(part.name, self.finish(part))
        for part in parts:
            if part.background and part.proc is not None:
                part.limit = min(part.limit, max(15.0, self.deadline - part.started))
                self.record(part.name, self.finish(part))
        return self.verdict()

    def verdict(self) -> int:
        parts = self.report["parts"]
        bad = [n for n, p in parts.items() if p["status"] == NO]
        self.report["verdict"] = NO if bad else YES
        self.save()
        print("\n=== device check: " + ("NO" if bad else "YES (every part that ran)")
              + f" in {self.report['elapsed_s']} s; JSON: {self.json_path}")
        for name, p in parts.items():
            print(f"  {p['status'].upper():7} {name}" + (f": {p['reason']}" if p.get("reason") else ""))
        rounds = [r for n in ("rounds", "rounds_graphs") for r in parts.get(n, {}).get("result", {}).get("configs", [])]
        for r in rounds:
            print("  " + summary_line(r))
        info = parts.get("rounds", {}).get("result", {})
        if info:
            print(f"  attention: {info.get('attention')}; vLLM's kernels: {info.get('vllm_unavailable') or 'found'}; "
                  f"ops: {info.get('ops')}")
        return 1 if bad else 0


def summary_line(r: dict) -> str:
    if "error" in r:
        return f"batch {r['batch']} budget {r['budget']}: {r['error']}"
    return (f"graphs={'on' if r['cuda_graphs'] else 'off'} ({r['graph_mode']}) batch {r['batch']:>2} budget "
            f"{r['budget']:>2}: glue {r['glue_ms']} ms, branch step {r['branch_step_ms']} ms, jit {r['jit_ms']} "
            f"ms/forward, answer {r['answer_ms']} ms, hits {r['hits']}, jit misses {r['jit_misses']}, branch steps "
            f"{r['branch_steps']}, transfers/forward {r['transfers_per_forward']}, fan-out {r['fanout']}, "
            f"attention {r['attention']}")


# ---- the benchmarks page ----------------------------------------------------------------------------------------
def report_lines(results: Path = RESULTS) -> list[str]:
    """The section of docs/benchmarks.md: the newest GPU device-check JSON in `results`, or that none ran."""
    found = [p for p in sorted(results.glob("*-device-check.json")) if json.loads(p.read_text()).get("mode") == "gpu"]
    out = ["## GPU device check", "",
           "`bash benchmarks/device_check.sh` on one H100/H200 ([dev/ops.md](dev/ops.md#gpu-check) says how); its "
           "JSON goes to benchmarks/results/.", ""]
    if not found:
        return out + ["Not run yet: no GPU result is recorded, so nothing on this page was measured on a GPU.", ""]
    data = json.loads(found[-1].read_text())
    env = data["parts"].get("environment", {}).get("result", {})
    gpu = env.get("gpu", {}).get("name", "no GPU")
    name = found[-1].name
    out += [f"[{name}](../benchmarks/results/{name}): verdict **{data.get('verdict', 'incomplete').upper()}**, {gpu}, "
            f"torch {env.get('torch')}, {data.get('elapsed_s')} s.", "",
            "| part | status | why / notes |", "|---|---|---|"]
    for name, p in data["parts"].items():
        out.append(f"| {name} | {p['status']} | {p.get('reason') or ''} |")
    out += ["", "| one-token forwards | batch | budget | glue ms | branch step ms | jit ms/forward | answer ms | hits "
            "| jit misses | transfers/forward | fan-out | attention |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for n in ("rounds", "rounds_graphs"):
        part = data["parts"].get(n, {}).get("result", {})
        for r in part.get("configs", []):
            if "error" not in r:
                out.append(f"| {r['graph_mode']} | {r['batch']} | {r['budget']} | {r['glue_ms']} "
                           f"| {r['branch_step_ms']} | {r['jit_ms']} | {r['answer_ms']} | {r['hits']} | "
                           f"{r['jit_misses']} | {r['transfers_per_forward']} | {r['fanout']} | {r['attention']} |")
    rounds = data["parts"].get("rounds", {}).get("result", {})
    if rounds:
        out += ["", f"Ops: {rounds.get('ops')}. vLLM's attention kernels: "
                f"{rounds.get('vllm_unavailable') or 'used where the table says vllm-*'}."]
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (seconds)")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole run's time budget")
    p.add_argument("--out", default="", help="folder of the JSON and log (default: $OUT, else benchmarks/results)")
    p.add_argument("--part", choices=sorted(PART_FUNCS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--graphs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        return run_part_here(args)
    import shutil

    import torch

    driver = Driver(args)
    return driver.run(plan(args, torch.cuda.is_available(), shutil.which("nvcc") is not None))


if __name__ == "__main__":
    sys.exit(main())
