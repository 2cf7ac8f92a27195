"""Run a real `vllm.LLM` in a fresh process and return what it generated (test helper, not a test).

A fresh interpreter per engine gives each engine the exact environment the test asks for (vLLM plugins run
at start-up in every engine process) and keeps engines from sharing state. The engine runs in one process
(front end, engine core and worker: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor), which starts
several times faster on 2 cores; the Saguaro drafter still runs in its own process.

    runs = run_engine(target, jobs=[Job("batch", prompts, {"temperature": 0, "max_tokens": 32})],
                      speculative_config={...})
    runs["batch"].token_ids, runs["batch"].spec.accepted

With `trace_verification=True` each job also returns how its verification steps ran (`JobResult.ranks`, one
`verify_trace.RankPaths` per worker rank: batch size, drafted rows, path, accepts and rejections per step).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from distribution import ENV_DEFAULTS, EngineRunError, SpecCounters, _spec_counters
from verify_trace import RankPaths

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 32,
    "disable_log_stats": False, "distributed_executor_backend": "uni",
}


@dataclasses.dataclass
class Job:
    """Prompts (text or token-id lists) generated with one set of SamplingParams fields.
    `sequential`: one request at a time (batch 1) instead of one batch."""

    name: str
    prompts: list[Any]
    params: dict[str, Any] | list[dict[str, Any]]  # one for all prompts, or one per prompt
    sequential: bool = False
    #: A command run (to completion) in the engine's process before the job starts, e.g. to stop or start a
    #: remote drafter between two jobs of one engine.
    before: list[str] | None = None


@dataclasses.dataclass
class JobResult:
    token_ids: list[list[int]]  # each prompt's first completion
    texts: list[str]
    spec: SpecCounters  # counters accumulated during this job only
    seconds: float
    #: Saguaro's own Prometheus samples at the end of the job (the proposer runs in the engine process),
    #: labelled ones as 'name{label="value"}'.
    saguaro: dict[str, float] = dataclasses.field(default_factory=dict)
    #: How much each Saguaro counter (`..._total`) grew during this job.
    saguaro_delta: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Prompt tokens vLLM's prefix cache served during this job (`vllm:prefix_cache_hits`).
    prefix_cache_hits: int = 0
    #: every completion of each prompt (`n` > 1)
    completions: list[list[list[int]]] = dataclasses.field(default_factory=list)
    #: steps each of Saguaro's shortcuts around vLLM's code served during this job (patches.SHORTCUT_STEPS)
    shortcuts: dict[str, int] = dataclasses.field(default_factory=dict)
    #: per worker rank, this job's verification steps (`run_engine(trace_verification=True)`, else empty)
    ranks: list[RankPaths] = dataclasses.field(default_factory=list)

    def counter(self, prefix: str) -> float:
        """Sum over labels of a Saguaro counter's growth in this job, e.g. `counter("vllm:saguaro_cache_hits")`."""
        return sum(v for k, v in self.saguaro_delta.items() if k.split("{")[0] == prefix + "_total")


def run_engine(model: str, jobs: list[Job], *, speculative_config: dict | None = None,
               engine_kwargs: dict | None = None, env: dict | None = None,
               timeout_s: float = 600.0, log_path: Path | None = None,
               trace_verification: bool = False) -> dict[str, JobResult]:
    """`log_path`: also keep the engine's log there (it is otherwise only shown when the engine fails)."""
    keep_log = log_path
    request = {"model": str(model), "speculative_config": speculative_config, "trace": trace_verification,
               "engine_kwargs": {**ENGINE_DEFAULTS, **(engine_kwargs or {})},
               "jobs": [dataclasses.asdict(j) for j in jobs]}
    with tempfile.TemporaryDirectory(prefix="saguaro-engine-") as tmp:
        req_path, out_path, log_path = (Path(tmp) / n for n in ("request.json", "result.json", "log"))
        req_path.write_text(json.dumps(request))
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, __file__, str(req_path), str(out_path)],
                                  env={**ENV_DEFAULTS, **os.environ, **(env or {})}, check=False,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if keep_log is not None:
            Path(keep_log).write_text(log_path.read_text())
        if proc.returncode != 0 or not out_path.exists():
            raise EngineRunError(proc.returncode, log_path.read_text()[-8000:])
        result = json.loads(out_path.read_text())
    return {name: JobResult(r["token_ids"], r["texts"], SpecCounters(**r["spec"]), r["seconds"], r["saguaro"],
                            r["saguaro_delta"], r["prefix_cache_hits"], r["completions"], r["shortcuts"],
                            [RankPaths.of(d) for d in r["ranks"]])
            for name, r in result.items()}


def _prefix_cache_hits(metrics: list[Any]) -> int:
    return sum(int(m.value) for m in metrics if m.name.removesuffix("_total") == "vllm:prefix_cache_hits")


def _inputs(prompt: Any) -> Any:
    return prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def _main(request: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from saguaro_vllm.patches import SHORTCUT_STEPS
    from saguaro_vllm.worker.metrics import saguaro_samples

    llm = LLM(model=request["model"], speculative_config=request["speculative_config"],
              **request["engine_kwargs"])
    if request["trace"]:
        from verify_trace import install_verify_trace, paths_delta, read_verify_paths

        llm.collective_rpc(install_verify_trace)
    results: dict[str, Any] = {}
    for job in request["jobs"]:
        if job.get("before"):
            subprocess.run(job["before"], check=True, timeout=300)
        paths_before = llm.collective_rpc(read_verify_paths) if request["trace"] else []
        before = _spec_counters(llm.get_metrics())
        hits_before = _prefix_cache_hits(llm.get_metrics())
        before_saguaro = saguaro_samples()
        shortcuts_before = dict(SHORTCUT_STEPS)
        params = job["params"] if isinstance(job["params"], list) else [job["params"]] * len(job["prompts"])
        sps = [SamplingParams(**p) for p in params]
        start = time.monotonic()
        if job["sequential"]:
            outs = [llm.generate([_inputs(p)], sp, use_tqdm=False)[0] for p, sp in zip(job["prompts"], sps)]
        else:
            outs = llm.generate([_inputs(p) for p in job["prompts"]], sps, use_tqdm=False)
        seconds = time.monotonic() - start
        after = _spec_counters(llm.get_metrics())
        results[job["name"]] = {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "completions": [[list(c.token_ids) for c in o.outputs] for o in outs],
            "texts": [o.outputs[0].text for o in outs],
            "spec": {k: after[k] - before[k] for k in after},
            "seconds": seconds,
            "prefix_cache_hits": _prefix_cache_hits(llm.get_metrics()) - hits_before,
            "saguaro": (after_saguaro := saguaro_samples()),
            "saguaro_delta": {k: v - before_saguaro.get(k, 0.0) for k, v in after_saguaro.items()
                              if k.split("{")[0].endswith("_total")},
            "shortcuts": {k: v - shortcuts_before.get(k, 0) for k, v in SHORTCUT_STEPS.items()},
            "ranks": [paths_delta(b, a) for b, a in zip(paths_before, llm.collective_rpc(read_verify_paths))]
            if request["trace"] else [],
        }
    return results


if __name__ == "__main__":
    req, out = sys.argv[1:3]
    Path(out).write_text(json.dumps(_main(json.loads(Path(req).read_text()))))
