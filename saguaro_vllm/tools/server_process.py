"""Start and stop a local `vllm serve` process (used by `make demo`, the server tests and benchmarks).

Binds to 127.0.0.1 only, on a free port; waits for `/health`; stops with SIGINT (vLLM's clean shutdown)
and kills the whole process group if that does not finish in time, so no engine or drafter is left behind.
With `prometheus_multiproc=True` the server runs in Prometheus multiprocess mode in a fresh directory
(removed on stop), so metrics recorded in the worker process (`vllm:saguaro_*`) show on `/metrics`.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command() -> list[str]:
    exe = Path(sys.executable).with_name("vllm")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class VLLMServer:
    def __init__(self, model: str, args: list[str], *, env: dict | None = None, log_path: str | None = None,
                 startup_timeout_s: float = 600.0, prometheus_multiproc: bool = False,
                 cpus: list[int] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*vllm_command(), "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.prometheus_dir: str | None = None
        if prometheus_multiproc:  # vLLM wants an empty directory per run (stale files skew the metrics)
            self.prometheus_dir = tempfile.mkdtemp(prefix="saguaro-prometheus-")
            self.env["PROMETHEUS_MULTIPROC_DIR"] = self.prometheus_dir
        self.cpus = cpus  # confine the whole server (every process it starts) to these cores
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._launched_at = 0.0

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (e.g. to boot one server while another one works)."""
        self._log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pin)
        self._launched_at = time.monotonic()

    def wait_ready(self) -> None:
        """Wait for `/health` (at most `startup_timeout_s` after `launch`); stops the server on failure."""
        deadline = self._launched_at + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} during start-up"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vllm serve did not become healthy within {self.startup_timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # stragglers of the group (engine core, worker, drafter)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self.proc = None
        if self.prometheus_dir is not None:
            shutil.rmtree(self.prometheus_dir, ignore_errors=True)

    def processes(self) -> list[tuple[str, "psutil.Process"]]:
        """(role, process) for the server and each live descendant: `server`, `engine core`, `worker`,
        `drafter` or `other` (e.g. multiprocessing's resource tracker). Used to find the drafter and to watch
        memory (fault tests, benchmarks/soak.py)."""
        import psutil

        if self.proc is None:
            return []
        root = psutil.Process(self.proc.pid)
        out = []
        for proc in [root, *root.children(recursive=True)]:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                out.append((process_role(proc.name(), proc.cmdline()) if proc is not root else "server", proc))
            except psutil.Error:  # exited meanwhile
                pass
        return out

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric_samples(self) -> dict[str, float]:
        """Every sample of `/metrics`, keyed `name` or `name{label="value",...}` as the page writes it."""
        return metric_samples(self.metrics_text())


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", re.M)


def metric_samples(text: str) -> dict[str, float]:
    """Parse a Prometheus text page into {sample (with its labels): value}."""
    return {m.group(1): float(m.group(2)) for m in _SAMPLE.finditer(text)}


def metric_totals(samples: dict[str, float]) -> dict[str, float]:
    """Each sample name of `metric_samples` summed over its labels."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        name = key.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + value
    return out


def sample_labels(key: str) -> dict[str, str]:
    """The labels of a `metric_samples` key: `name{a="1",b="x"}` -> {"a": "1", "b": "x"}."""
    _, _, inner = key.partition("{")
    return dict(re.findall(r'(\w+)="([^"]*)"', inner.rstrip("}")))


def drafter_state(samples: dict[str, float], engine: str | None = None) -> str | None:
    """The drafter client's state: the `state` label of `vllm:saguaro_drafter_state` that is 1, for `engine`
    (its data-parallel rank) or, when not given, the one state every engine is in (None if not one)."""
    states = set()
    for key, value in samples.items():
        if key.startswith("vllm:saguaro_drafter_state{") and value == 1:
            labels = sample_labels(key)
            if engine is None or labels.get("engine") == engine:
                states.add(labels.get("state"))
    return states.pop() if len(states) == 1 else None


def process_role(name: str, cmdline: list[str]) -> str:
    """What a process under `vllm serve` is, from vLLM's process titles and the drafter's module name."""
    if "saguaro_vllm.drafter.server" in " ".join(cmdline):
        return "drafter"
    if name.startswith("VLLM::EngineCore"):
        return "engine core"
    if name.startswith("VLLM::Worker"):
        return "worker"
    return "other"
