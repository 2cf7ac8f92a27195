"""How long a drafter fault pauses the streams of `vllm serve`, and where the time goes.

The fault test's setting (tests/serve_faults.py on the server of tests/serve_cases.py: the tiny pair, 8
greedy streams of 320 tokens, the fault injected once every stream has 3 chunks), repeated: per repeat and
fault (SIGKILL, SIGSTOP) one healthy batch, one faulty batch, recovery. Per faulty batch:

- the longest gap between two chunks of one stream, where it lies after the injection, and the faulty
  batch's time over the healthy one's (issue 44's goals: after a death no gap over 1 s; after a hang none
  over the step deadline floor + 0.5 s; a faulty batch within 2 s of the healthy one);
- the healthy batch's longest gap and where it lies (preemption shows there, not only in faulty batches);
- every process's CPU share (this benchmark's process as `client`, server, engine core, worker, each
  drafter) and its threads' run-queue waits (ready, not running) in the longest gap and in the healthy
  batch, sampled from /proc every 20 ms;
- the Saguaro log lines the fault caused, each timed as it reached the log (a tail read every 10 ms);
- with `--py-spy`, non-blocking dumps of the engine core and the worker every 0.1 s during the 3 s after the
  injection; with `--py-spy-record`, 3 s of their and the server's stacks sampled at 200 Hz (both perturb
  what they measure: the gap figures of such runs are not reported).

The chunks are timed by tests/stream_reader.py, a process of its own at real-time priority where allowed:
a reader inside a busy process on 2 cores reads them late (benchmarks/notes.md "A drafter fault's pause").

Every output must equal the plain server's greedy output (checked per batch). Results:
`benchmarks/results/<date>-fault-pauses[-label].json` and a plot beside it.

    .venv/bin/python benchmarks/fault_pauses.py --repeats 10
    .venv/bin/python benchmarks/fault_pauses.py --repeats 2 --py-spy --label stacks
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
# the fault test's environment (tests/conftest.py): a small CPU KV cache, test helpers importable by the engine
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))

import serve_cases  # noqa: E402  (tests/: the fault test's server and batches)
import serve_faults  # noqa: E402
from tiny_models import build_tiny_pair  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SAMPLE_S = 0.02
FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}


def _cpu_and_wait(pid: int) -> dict[int, tuple[float, float]]:
    """Per thread of `pid`: seconds on a CPU and seconds waiting on a run queue (ready, not running), from
    /proc/PID/task/TID/schedstat (the scheduler's own accounting, in ns)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                on_cpu, queued, _ = f.read().split()
        except OSError:  # a thread that exited meanwhile
            continue
        out[int(tid)] = (int(on_cpu) / 1e9, int(queued) / 1e9)
    return out


class CpuSampler(threading.Thread):
    """Every SAMPLE_S: the CPU seconds and state of each process of the server's tree, by role and pid."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.samples, self.stop = server, [], threading.Event()

    def run(self):
        procs: dict[int, tuple[str, psutil.Process]] = {}
        next_scan = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_scan:  # new processes (a replacement drafter) every 0.1 s
                for role, p in self.server.processes():
                    procs.setdefault(p.pid, (role, p))
                next_scan = now + 0.1
            row = {os.getpid(): ("client", _cpu_and_wait(os.getpid()))}
            for pid, (role, p) in list(procs.items()):
                try:
                    row[pid] = (role, _cpu_and_wait(pid))
                except OSError:
                    procs.pop(pid)
            self.samples.append((now, row))
            time.sleep(SAMPLE_S)

    def shares(self, start: float, end: float, column: int = 0) -> dict[str, float]:
        """CPU seconds per second of each role (drafters by pid) between start and end; with `column` 1,
        the seconds per second its threads waited on a run queue instead. Summed over the threads alive at
        both ends (the client's stream threads come and go)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            before = [s for s in self.samples if s[0] <= start][-1:]
            after = [s for s in self.samples if s[0] >= end][:1]
            inside = before + after
        if len(inside) < 2:
            return {}
        (t0, a), (t1, b) = inside[0], inside[-1]
        out = {}
        for pid, (role, threads) in b.items():
            name = f"{role} {pid}" if role == "drafter" else role
            earlier = a.get(pid, (role, {}))[1]
            total = sum(v[column] - earlier[tid][column] for tid, v in threads.items() if tid in earlier)
            out[name] = round(total / max(t1 - t0, 1e-9), 3)
        return out


class LogTail(threading.Thread):
    """The server log's new lines, each with the time it was read (every 10 ms)."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.lines, self.stop = path, [], threading.Event()

    def run(self):
        with open(self.path, errors="replace") as f:
            f.seek(0, os.SEEK_END)
            buf = ""
            while not self.stop.is_set():
                chunk = f.read()
                if chunk:
                    buf += chunk
                    *done, buf = buf.split("\n")
                    now = time.monotonic()
                    self.lines.extend((now, ln) for ln in done)
                else:
                    time.sleep(0.01)


def py_spy_dumps(server, until: float, out: list) -> None:
    """Non-blocking py-spy dumps of the engine core and the worker every 0.1 s until `until`: each thread's
    name and its innermost frames."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    targets = [(r, p.pid) for r, p in server.processes() if r in ("engine core", "worker")]
    while time.monotonic() < until:
        t = time.monotonic()
        for role, pid in targets:
            r = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                               timeout=10)
            threads, current = [], None
            for ln in r.stdout.splitlines():
                if ln.startswith("Thread "):
                    current = {"thread": ln.strip(), "frames": []}
                    threads.append(current)
                elif current is not None and ln.strip() and len(current["frames"]) < 4:
                    current["frames"].append(ln.strip())
            out.append({"t": t, "role": role, "threads": threads})
        time.sleep(max(0.0, 0.1 - (time.monotonic() - t)))


def py_spy_record(server, seconds: float, out: list) -> None:
    """py-spy record (200 Hz, without pausing the process) of the engine core and the worker for `seconds`:
    their collapsed stacks with sample counts, the heaviest first, appended to `out` once done."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    for role, p in server.processes():
        if role not in ("engine core", "worker", "server"):
            continue
        fd, path = tempfile.mkstemp(suffix=".txt")
        os.close(fd)

        def collect(role=role, pid=p.pid, path=path):
            subprocess.run([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                            "--nonblocking", "--format", "raw", "--output", path], capture_output=True, timeout=60)
            counts = []
            for line in Path(path).read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                counts.append((int(n), stack))
            os.unlink(path)
            counts.sort(reverse=True)
            out.append({"t": time.monotonic(), "role": role, "samples": sum(n for n, _ in counts),
                        "stacks": [{"n": n, "stack": ";".join(f.split(" (")[0] for f in s.split(";")[-6:])}
                                   for n, s in counts[:25]]})
        threading.Thread(target=collect, daemon=True).start()


def one_fault(server, reference, fault: str, sampler: CpuSampler, tail: LogTail, spy: bool,
              record: bool = False) -> dict:
    serve_faults.wait_drafting(server)
    healthy = serve_faults.run_batch(server)
    assert not healthy.errors and healthy.texts == reference, healthy.errors
    restarts = serve_faults._total(serve_faults.metrics(server), serve_faults.RESTARTS)
    victim: list[psutil.Process] = []
    stacks: list[dict] = []

    def inject():
        victim.append(serve_faults.the_drafter(server))
        victim[0].send_signal(FAULTS[fault])
        if spy:
            threading.Thread(target=py_spy_dumps, args=(server, time.monotonic() + 3.0, stacks), daemon=True).start()
        if record:
            py_spy_record(server, 3.0, stacks)

    faulty = serve_faults.run_batch(server, inject)
    assert not faulty.errors, faulty.errors
    assert faulty.texts == reference, "a faulty batch's output differs from the target's"
    stream, g0, g1 = faulty.longest_gap()
    inj = faulty.injected
    gaps_after = sorted((b - a for arr in faulty.arrivals for a, b in zip(arr, arr[1:]) if b > inj), reverse=True)
    log = [{"at_s": round(t - inj, 3), "line": ln.split("] ", 1)[-1][:220]} for t, ln in tail.lines
           if faulty.started <= t <= faulty.started + faulty.seconds and ("Saguaro" in ln or "drafter" in ln)]
    row = {"fault": fault, "healthy_s": round(healthy.seconds, 3), "faulty_s": round(faulty.seconds, 3),
           "over_healthy_s": round(faulty.seconds - healthy.seconds, 3), "longest_gap_s": round(g1 - g0, 3),
           "gap_from_s": round(g0 - inj, 3), "gap_to_s": round(g1 - inj, 3), "gap_stream": stream,
           "next_gaps_s": [round(g, 3) for g in gaps_after[1:4]],
           "reader_realtime": faulty.realtime,
           "healthy_longest_gap_s": round(healthy.max_gap_s, 3),
           "healthy_gap_at_s": [round(x - healthy.started, 3) for x in healthy.longest_gap()[1:]],
           "healthy_first_chunk_s": round(min(a[0] for a in healthy.arrivals if a) - healthy.started, 3),
           "healthy_log": [{"at_s": round(t - healthy.started, 3), "line": ln.split("] ", 1)[-1][:220]}
                           for t, ln in tail.lines if healthy.started <= t <= healthy.started + healthy.seconds
                           and ("Saguaro" in ln or "drafter" in ln)],
           "chunks": {"healthy": sum(map(len, healthy.arrivals)), "faulty": sum(map(len, faulty.arrivals))},
           "cpu_in_gap": sampler.shares(g0, g1),
           "runqueue_wait_in_gap": sampler.shares(g0, g1, column=1),
           "cpu_healthy": sampler.shares(healthy.started, healthy.started + healthy.seconds),
           "runqueue_wait_healthy": sampler.shares(healthy.started, healthy.started + healthy.seconds, column=1),
           "log": log}
    if record:
        time.sleep(4.0)  # the recorders end 3 s after the injection
    if spy or record:
        row["stacks"] = [{**s, "t": round(s["t"] - inj, 3)} for s in stacks]
    serve_faults.wait_drafting(server, restarts_at_least=restarts + 1)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for fault in FAULTS:
        rs = [r for r in rows if r["fault"] == fault]
        if not rs:
            continue
        gaps = sorted(r["longest_gap_s"] for r in rs)
        over = sorted(r["over_healthy_s"] for r in rs)
        out[fault] = {"runs": len(rs), "longest_gap_s": {"min": gaps[0], "median": statistics.median(gaps),
                                                         "max": gaps[-1], "all": gaps},
                      "over_healthy_s": {"min": over[0], "median": statistics.median(over), "max": over[-1],
                                         "all": over}}
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "longest_gap_s", "longest gap between two chunks (s)"),
                           (axes[1], "over_healthy_s", "faulty batch - healthy batch (s)")):
        for i, fault in enumerate(FAULTS):
            vals = [r[key] for r in rows if r["fault"] == fault]
            ax.scatter([i] * len(vals), vals, alpha=0.7)
        ax.set_xticks(range(len(FAULTS)), list(FAULTS))
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _name(label: str) -> str:
    return f"{datetime.date.today().isoformat()}-fault-pauses" + (f"-{label}" if label else "")


def _write_partial(rows: list[dict], args) -> None:
    """The runs so far (a run cut short keeps what it measured): <date>-fault-pauses[-label].partial.json."""
    (RESULTS / f"{_name(args.label)}.partial.json").write_text(json.dumps({"summary": summary(rows), "runs": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--faults", default="sigkill,sigstop")
    ap.add_argument("--mode", default="async", choices=["async", "sync"])
    ap.add_argument("--py-spy", action="store_true", help="sample the stacks of the server, engine core and worker")
    ap.add_argument("--py-spy-record", action="store_true",
                    help="record (200 Hz) the server's, engine core's and worker's stacks for 3 s after the injection")
    ap.add_argument("--label", default="")
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    faults = args.faults.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="fault-pauses-"))
    pair = build_tiny_pair(tmp / "pair")
    with serve_cases._server(pair, tmp, "plain") as plain:
        reference = serve_faults.reference_batch(plain)
    server = serve_cases._server(pair, tmp, args.mode)
    cfg = json.loads((tmp / f"saguaro-{args.mode}.json").read_text())  # the fault test's config, with restarts
    cfg["saguaro"]["max_restarts"] = 10 * len(faults) * args.repeats  # for every fault of the run
    (tmp / f"saguaro-{args.mode}.json").write_text(json.dumps(cfg))
    rows: list[dict] = []
    load = []
    with server:
        sampler, tail = CpuSampler(server), LogTail(server.log_path)
        sampler.start()
        tail.start()
        todo = [(r, f) for r in range(args.repeats) for f in faults]
        for r, fault in tqdm(todo, desc="faults", unit="fault"):
            row = one_fault(server, reference, fault, sampler, tail, args.py_spy, args.py_spy_record)
            row["repeat"] = r
            rows.append(row)
            load.append(os.getloadavg()[0])
            _write_partial(rows, args)
            tqdm.write(f"{fault} #{r}: longest gap {row['longest_gap_s']:.2f} s at +{row['gap_from_s']:.2f} s, "
                       f"over healthy {row['over_healthy_s']:+.2f} s; CPU in the gap {row['cpu_in_gap']}")
        sampler.stop.set()
        tail.stop.set()
    result = {"benchmark": "fault_pauses", "date": datetime.date.today().isoformat(),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                          "load_1min_mean": round(statistics.mean(load), 2) if load else None},
              "settings": {"repeats": args.repeats, "faults": faults, "mode": args.mode, "py_spy": args.py_spy,
                           "streams": len(serve_faults.PROMPTS), "max_tokens": serve_faults.MAX_TOKENS,
                           "fault_after_chunks": serve_faults.FAULT_AFTER_CHUNKS},
              "note": args.note, "summary": summary(rows), "runs": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = _name(args.label)
    out = RESULTS / f"{name}.json"
    out.write_text(json.dumps(result, indent=1))
    (RESULTS / f"{name}.partial.json").unlink(missing_ok=True)
    plot(rows, RESULTS / f"{name}.png")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
