"""Run one `vllm.LLM` (any tensor-parallel size) in a fresh process and return what it generated plus what
every worker rank committed (test helper, not a test).

Each worker records, after every step, the committed token ids of every request in its batch
(`input_batch.token_ids_cpu[i, :num_tokens_no_spec[i]]`, the tokens the next step's input is built from);
the recorder is installed per runner instance through `collective_rpc`, so no vLLM code is patched for it.
Each job also returns, per rank, the path every verification step took (verify_trace.py).

    runs, ranks = run_tp_engine(target, [Job("t1", prompts, {"temperature": 1.0, "max_tokens": 5})],
                                engine_kwargs={"tensor_parallel_size": 2}, speculative_config={...})
    ranks[0][req_id] == ranks[1][req_id]
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

import numpy as np

from distribution import ENV_DEFAULTS, EngineRunError, SpecCounters, _spec_counters
from engine_runs import Job
from verify_trace import RankPaths, install_verify_trace, paths_delta, read_verify_paths

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 256,
    "max_num_batched_tokens": 2048, "skip_tokenizer_init": True, "disable_log_stats": False,
}


@dataclasses.dataclass
class TPJobResult:
    token_ids: list[list[int]]
    request_ids: list[str]
    spec: SpecCounters  # vLLM's spec-decode counters, this job only
    seconds: float
    saguaro_delta: dict[str, float]  # growth of each Saguaro counter in this job
    ranks: list[RankPaths]  # per worker rank: how each of this job's verification steps ran there

    @property
    def tokens(self) -> np.ndarray:
        """[requests, tokens] array (every request of the job has the same max_tokens)."""
        return np.asarray(self.token_ids, dtype=np.int64)

    def counter(self, prefix: str) -> float:
        return sum(v for k, v in self.saguaro_delta.items() if k.split("{")[0] == prefix + "_total")


def record_committed_tokens(worker: Any) -> int:
    """collective_rpc: wrap this worker's runner instance's `sample_tokens` to record committed tokens."""
    runner = worker.model_runner
    runner.committed_tokens_by_request = {}
    sample_tokens = runner.sample_tokens

    def recording_sample_tokens(*args: Any, **kwargs: Any) -> Any:
        out = sample_tokens(*args, **kwargs)
        batch = runner.input_batch
        for i, rid in enumerate(batch.req_ids):
            if rid is not None:
                runner.committed_tokens_by_request[rid] = batch.token_ids_cpu[i, : batch.num_tokens_no_spec[i]].tolist()
        return out

    runner.sample_tokens = recording_sample_tokens
    return os.getpid()


def read_committed_tokens(worker: Any) -> dict[str, list[int]]:
    return worker.model_runner.committed_tokens_by_request


def read_saguaro_samples(worker: Any) -> dict[str, float]:
    """collective_rpc: Saguaro's Prometheus samples in this worker's process (the proposer lives there)."""
    from saguaro_vllm.worker.metrics import saguaro_samples

    return saguaro_samples()


def run_tp_engine(model: str, jobs: list[Job], *, speculative_config: dict | None = None,
                  engine_kwargs: dict | None = None, env: dict | None = None, seed: int = 0,
                  timeout_s: float = 600.0) -> tuple[dict[str, TPJobResult], list[dict[str, list[int]]]]:
    """(per job: outputs; per worker rank: request id -> committed token ids, prompt included)."""
    request = {"model": str(model), "speculative_config": speculative_config, "seed": seed,
               "engine_kwargs": {**ENGINE_DEFAULTS, **(engine_kwargs or {})},
               "jobs": [dataclasses.asdict(j) for j in jobs]}
    with tempfile.TemporaryDirectory(prefix="saguaro-tp-") as tmp:
        req_path, out_path, log_path = (Path(tmp) / n for n in ("request.json", "result.json", "log"))
        req_path.write_text(json.dumps(request))
        with open(log_path, "w") as log:
            # cwd: the drafter runs `python -m`, which puts the cwd first on sys.path; a neutral cwd keeps
            # the package found through the environment.
            proc = subprocess.run([sys.executable, __file__, str(req_path), str(out_path)], cwd=tmp,
                                  env={**ENV_DEFAULTS, **os.environ, **(env or {})}, check=False,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.exists():
            raise EngineRunError(proc.returncode, log_path.read_text()[-8000:])
        result = json.loads(out_path.read_text())
    runs = {name: TPJobResult(r["token_ids"], r["request_ids"], SpecCounters(**r["spec"]), r["seconds"],
                              r["saguaro_delta"], [RankPaths.of(d) for d in r["ranks"]])
            for name, r in result["jobs"].items()}
    return runs, result["ranks"]


def _main(request: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["model"], speculative_config=request["speculative_config"], seed=request["seed"],
              **request["engine_kwargs"])
    llm.collective_rpc(record_committed_tokens)
    llm.collective_rpc(install_verify_trace)

    def saguaro_samples() -> dict[str, float]:
        return llm.collective_rpc(read_saguaro_samples)[0]  # rank 0: the rank that talks to the drafter
    results: dict[str, Any] = {}
    for job in request["jobs"]:
        before, before_saguaro = _spec_counters(llm.get_metrics()), saguaro_samples()
        paths_before = llm.collective_rpc(read_verify_paths)
        params = job["params"] if isinstance(job["params"], list) else [job["params"]] * len(job["prompts"])
        sps = [SamplingParams(**{"ignore_eos": True, "detokenize": False, **p}) for p in params]
        prompts = [{"prompt_token_ids": p} for p in job["prompts"]]
        start = time.monotonic()
        if job["sequential"]:
            outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, sps)]
        else:
            outs = llm.generate(prompts, sps, use_tqdm=False)
        seconds = time.monotonic() - start
        after, after_saguaro = _spec_counters(llm.get_metrics()), saguaro_samples()
        results[job["name"]] = {
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "request_ids": [o.request_id for o in outs],
            "spec": {k: after[k] - before[k] for k in after}, "seconds": seconds,
            "saguaro_delta": {k: v - before_saguaro.get(k, 0.0) for k, v in after_saguaro.items()
                              if k.split("{")[0].endswith("_total")},
            "ranks": [paths_delta(b, a) for b, a in zip(paths_before, llm.collective_rpc(read_verify_paths))],
        }
    return {"jobs": results, "ranks": llm.collective_rpc(read_committed_tokens)}


if __name__ == "__main__":
    req, out = sys.argv[1:3]
    Path(out).write_text(json.dumps(_main(json.loads(Path(req).read_text()))))
