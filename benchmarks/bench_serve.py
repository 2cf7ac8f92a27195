"""vLLM's own serving benchmark (`vllm bench serve`) against every engine: vLLM AR, vLLM `draft_model`,
Saguaro `sync` and Saguaro `async` (SSD), each a `vllm serve` of the same target.

Engines start one after the other, with run.py's specs and placement (`split`: vLLM AR and `draft_model`
confined whole to `--target-cores`; Saguaro pins its worker there and its drafter to `--draft-cores`;
`equal`: vLLM engines unpinned). Each is driven by `vllm bench serve` (the CLI, a subprocess, unpinned) at
every `--concurrency` (`--max-concurrency`, all requests sent at once), on each dataset:
- `random`: vLLM's random dataset (`--input-len` random tokens per prompt);
- `corpus`: held-out snippets of the demo corpus (files no model was trained on), as vLLM's `custom`
  JSONL dataset (no chat template);
greedy and sampled (`--temperatures`), `--output-len` tokens per request (ignore_eos), the same seed (so
the same prompts) for every engine. vLLM's result JSON of every run is kept (`--save-result`, under
`benchmarks/results/serve/<date>-<label>/`); its spec-decode figures (acceptance rate and length) come from
the server's `/metrics` counters before and after the run, and this script reads `/metrics` too, for the
speculation-cache hit rate of SSD. A merged summary goes to `benchmarks/results/<date>-serve-<label>.json`;
`benchmarks/report.py` renders it on docs/benchmarks.md (TTFT / TPOT / ITL p50 and p99, output tokens/s,
acceptance) with a plot of TPOT against concurrency.

    .venv/bin/python benchmarks/bench_serve.py                       # the full matrix (hours on 2 cores)
    .venv/bin/python benchmarks/bench_serve.py --cases corpus:0,corpus:0.7,random:0 --output-len 32 --input-len 64 \\
        --requests-per-client 1 --min-requests 2 --client reuse --label reduced   # the page's run (~47 min)
    .venv/bin/python benchmarks/bench_serve.py --concurrency 1,4 --cases corpus:0 --output-len 32 \\
        --label smoke                                                 # a few minutes (not on the page)

`--client cli` (default) runs every measurement as a fresh `vllm bench serve` process; `--client reuse`
passes the same arguments to vLLM's bench parser and `main` in one process per engine (no 10-30 s vLLM
import per run). Servers get `VLLM_CPU_KVCACHE_SPACE` GiB of KV cache (default 4). Needs `pandas` (the
`bench` extra) for vLLM's `custom` dataset.

Model: the demo pair's cost-matched models (built and cached if missing), or `--target/--draft`.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

from run import engine_family, engine_pin, engine_specs, machine_info, run_date, ssd_figures  # noqa: E402

SERVED_NAME = "demo"
ENGINES = "vllm-ar,vllm-draft_model,saguaro-sync,saguaro-async"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
#: vLLM's result-JSON keys a summary row keeps (milliseconds; `p50`/`p99` from --metric-percentiles 50,99).
LATENCY_KEYS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
                for stat in ("mean", "p50", "p99")]
THROUGHPUT_KEYS = ("output_throughput", "request_throughput", "total_token_throughput", "duration",
                   "completed", "failed", "total_input_tokens", "total_output_tokens", "max_concurrent_requests")
SPEC_KEYS = ("spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
             "spec_decode_draft_tokens", "spec_decode_accepted_tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=ENGINES)
    p.add_argument("--concurrency", default="1,4,16,64", help="`vllm bench serve --max-concurrency` values")
    p.add_argument("--datasets", default="random,corpus", help="random and/or corpus")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--cases", help="DATASET:T,... instead of every --datasets x --temperatures pair "
                   "(e.g. corpus:0,corpus:0.7,random:0)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the random dataset")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests per run = max(concurrency x this, --min-requests)")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens of draft_model, sync and async")
    p.add_argument("--models", choices=["raw", "cost"], default="cost", help="demo pair models (as run.py)")
    p.add_argument("--target", help="any Hugging Face model directory (instead of the demo pair)")
    p.add_argument("--draft", help="draft model directory for --target")
    p.add_argument("--target-cores", default="0")
    p.add_argument("--draft-cores", default="1")
    p.add_argument("--placement", choices=["split", "equal"], default="split")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="matrix", help="result: benchmarks/results/<date>-serve-<label>.json")
    p.add_argument("--note", default="", help="free text stored with the result (e.g. machine contention)")
    p.add_argument("--run-timeout-s", type=float, default=1800, help="limit of one `vllm bench serve` run")
    p.add_argument("--client", choices=["cli", "reuse"], default="cli",
                   help="cli: each run a fresh `vllm bench serve` process; reuse: the same arguments through "
                        "vLLM's bench parser and main in one process per engine (no vLLM import per run)")
    p.add_argument("--extend", type=Path, metavar="RESULT_JSON",
                   help="add this run's cases to an earlier result of the same settings (same pair, K, lengths, "
                        "requests, client) instead of writing a new one; each run keeps its own load average")
    p.add_argument("--client-worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.engines = a.engines.split(",")
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.datasets = a.datasets.split(",")
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    a.cases = ([(d, float(t)) for d, t in (c.split(":") for c in a.cases.split(","))] if a.cases
               else list(itertools.product(a.datasets, a.temperatures)))
    a.datasets = list(dict.fromkeys(d for d, _ in a.cases))
    a.temperatures = list(dict.fromkeys(t for _, t in a.cases))
    if set(a.datasets) - {"random", "corpus"}:
        p.error(f"--datasets: random and/or corpus, got {a.datasets}")
    if set(a.engines) - set(ENGINES.split(",")):
        p.error(f"--engines: choose from {ENGINES}")
    if (a.target is None) != (a.draft is None):
        p.error("--target and --draft go together")
    return a


# ------------------------------------------------------------------------------------------ pieces

def num_requests(a: argparse.Namespace, concurrency: int) -> int:
    return max(concurrency * a.requests_per_client, a.min_requests)


def write_corpus_jsonl(prompts: list[str], path: Path) -> Path:
    """vLLM's `custom` dataset: one {"prompt": ...} per line."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def bench_command(a: argparse.Namespace, url: str, tokenizer: str, dataset: str, corpus: Path | None,
                  temperature: float, concurrency: int, result_dir: Path, filename: str,
                  metadata: dict[str, str]) -> list[str]:
    """The `vllm bench serve` command line of one run."""
    from saguaro_vllm.tools.server_process import vllm_command

    cmd = [*vllm_command(), "bench", "serve", "--backend", "openai", "--base-url", url, "--model", SERVED_NAME,
           "--tokenizer", tokenizer, "--num-prompts", str(num_requests(a, concurrency)),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
           "--temperature", f"{temperature:g}", "--seed", str(a.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
           "--disable-tqdm", "--metadata", *[f"{k}={v}" for k, v in metadata.items()]]
    if dataset == "random":
        cmd += ["--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len)]
    else:
        cmd += ["--dataset-name", "custom", "--dataset-path", str(corpus), "--custom-output-len",
                str(a.output_len), "--skip-chat-template"]
    return cmd


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Growth of every `/metrics` sample (labels kept) over a run."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def summary_row(result: dict, delta: dict[str, float] | None = None) -> dict:
    """One run's figures from vLLM's result JSON (and, for Saguaro, the hit rate from the `/metrics` delta)."""
    row = {k: result.get(k) for k in (*LATENCY_KEYS, *THROUGHPUT_KEYS, *SPEC_KEYS)}
    if row["spec_decode_acceptance_rate"] is not None:  # vLLM writes it in percent
        row["spec_decode_acceptance_rate"] /= 100
    if delta:
        from saguaro_vllm.tools.server_process import metric_totals

        totals = metric_totals(delta)
        sag = {k.replace('{engine="0",', "{").replace(',engine="0"}', "}"): v for k, v in delta.items()
               if k.startswith("vllm:saguaro_")}
        figs = ssd_figures(sag)
        row["hit_rate"] = figs.get("hit_rate")
        row["backups"] = figs.get("backups")
        drafts, tokens = totals.get(DRAFTS, 0.0), totals.get(DRAFT_TOKENS, 0.0)
        row["metrics_acceptance_rate"] = totals.get(ACCEPTED, 0.0) / tokens if tokens else None
        row["metrics_acceptance_length"] = 1 + totals.get(ACCEPTED, 0.0) / drafts if drafts else None
    return row


def kv_cache_gb() -> str:
    """The servers' KV cache (GiB, VLLM_CPU_KVCACHE_SPACE): 4 by default, enough for 64 requests of ~250
    tokens of the cost-matched target (200 KiB per token)."""
    return os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")


def merge(runs: list[dict]) -> dict[str, dict]:
    """`dataset|T<t>|c<c>` -> engine family -> its row (the layout the report reads)."""
    out: dict[str, dict] = {}
    for r in runs:
        out.setdefault(f"{r['dataset']}|T{r['temperature']:g}|c{r['concurrency']}", {})[r["engine"]] = r["row"]
    return out


#: Settings two results must share before one may extend the other (they change every figure).
SAME_SETTINGS = ("k", "output_len", "random_input_len", "requests", "seed", "max_model_len", "client")


def extend_result(old: dict, new: dict) -> dict:
    """`old` with `new`'s runs added (a run of the same engine, dataset, T and concurrency replaced), its cases
    and concurrencies joined, and `new`'s command, date, load and runtime kept under `extended`."""
    for key in ("target", "draft", "placement"):
        if old[key] != new[key]:
            raise SystemExit(f"--extend: {key} differs ({old[key]!r} there, {new[key]!r} here)")
    for key in SAME_SETTINGS:
        if old["settings"].get(key) != new["settings"].get(key):
            raise SystemExit(f"--extend: setting {key} differs ({old['settings'].get(key)!r} there, "
                             f"{new['settings'].get(key)!r} here); rerun with the earlier result's settings")
    key = lambda r: (r["engine"], r["dataset"], r["temperature"], r["concurrency"])  # noqa: E731
    fresh = {key(r) for r in new["runs"]}
    runs = [r for r in old["runs"] if key(r) not in fresh] + new["runs"]
    settings = dict(old["settings"])
    for name in ("cases", "concurrency", "datasets", "temperatures"):
        settings[name] = list(dict.fromkeys([*old["settings"][name], *new["settings"][name]]))
    extended = [*old.get("extended", []), {k: new[k] for k in ("date", "command", "note", "load_avg", "runtime_s")}
                | {"cases": new["settings"]["cases"], "result_dir": new["result_dir"]}]
    return old | {"settings": settings, "runs": runs, "summary": merge(runs), "extended": extended}


# ------------------------------------------------------------------------------------------ driver

def serve_engine(engine: str, spec: dict | None, pin: list[int] | None, a: argparse.Namespace, target: str,
                 corpus: Path | None, result_dir: Path, tmp: Path, bar: tqdm) -> list[dict]:
    """Start one engine's server, run every (dataset, temperature, concurrency) against it, stop it."""
    from saguaro_vllm.tools.server_process import VLLMServer

    args = ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", str(a.max_model_len),
            "--enforce-eager", "--max-num-seqs", str(max(a.concurrency)), "--seed", str(a.seed)]
    if spec is not None:
        cfg = tmp / f"{engine}.json"
        cfg.write_text(json.dumps(spec))
        args += ["--speculative-config", str(cfg)]
    log = tmp / f"{engine}.log"
    server = VLLMServer(target, args, log_path=str(log), prometheus_multiproc=True, cpus=pin,
                        env={"VLLM_CPU_KVCACHE_SPACE": kv_cache_gb()})
    # Warm-up (not kept): greedy and sampled paths, a small batch. Then every measured run.
    small = argparse.Namespace(**{**vars(a), "output_len": 16, "requests_per_client": 1, "min_requests": 4})
    jobs = [{"name": f"warmup-t{t:g}", "keep": False, "result": str(tmp / f"warmup-t{t:g}.json"),
             "cmd": bench_command(small, "URL", target, "corpus" if corpus else "random", corpus, t, 4, tmp,
                                  f"warmup-t{t:g}.json", {})} for t in sorted(set(a.temperatures))]
    for (dataset, t), c in itertools.product(a.cases, a.concurrency):
        name = f"{engine}-{dataset}-t{t:g}-c{c}.json"
        meta = {"engine": engine, "dataset": dataset, "concurrency": str(c), "placement": a.placement,
                "pinned": ",".join(map(str, pin)) if pin else "none", "client": a.client}
        jobs.append({"name": name, "keep": True, "result": str(result_dir / name), "dataset": dataset,
                     "temperature": t, "concurrency": c,
                     "cmd": bench_command(a, "URL", target, dataset, corpus, t, c, result_dir, name, meta)})
    t0 = time.monotonic()
    try:
        server.start()
    except Exception:
        tqdm.write(log.read_text()[-4000:] if log.exists() else "")
        raise
    try:
        startup_s = time.monotonic() - t0
        tqdm.write(f"[bench-serve] {engine}: ready after {startup_s:.0f} s" + (f" (pinned to {pin})" if pin else ""))
        for job in jobs:
            job["cmd"] = [server.url if x == "URL" else x for x in job["cmd"]]
        done = run_jobs(jobs, server.url, tmp / engine, a, bar)
    finally:
        server.stop()
    runs = []
    for job, got in zip(jobs, done):
        if not job["keep"]:
            continue
        row = summary_row(json.loads(Path(job["result"]).read_text()), got["delta"])
        Path(job["result"]).with_suffix(".metrics-delta.json").write_text(json.dumps(got["delta"], indent=0))
        runs.append({"engine": engine_family(engine), "dataset": job["dataset"], "temperature": job["temperature"],
                     "concurrency": job["concurrency"], "num_prompts": num_requests(a, job["concurrency"]),
                     "file": str(Path(job["result"]).relative_to(ROOT)), "wall_s": got["wall_s"],
                     "load_avg_1m": got["load"], "startup_s": round(startup_s, 1), "row": row})
        acc = row["spec_decode_acceptance_length"]
        tqdm.write(f"{engine:22s} {job['dataset']:6s} T={job['temperature']:<3g} c={job['concurrency']:<3d} "
                   f"TPOT p50 {row['p50_tpot_ms']:7.1f} ms, {row['output_throughput']:6.1f} out tok/s"
                   + (f", accept len {acc:.2f}" if acc else "")
                   + (f", hit rate {row['hit_rate']:.3f}" if row.get("hit_rate") is not None else ""))
    return runs


def run_jobs(jobs: list[dict], url: str, work: Path, a: argparse.Namespace, bar: tqdm) -> list[dict]:
    """Run `vllm bench serve` jobs in order against one server; per job, the `/metrics` delta over the run,
    its wall time and the 1-minute load average before and after.

    `--client cli`: each job is the `vllm bench serve` command line, a fresh process. `--client reuse`: the
    same arguments go through the same parser and `main` of `vllm bench serve` (vllm.benchmarks.serve) in
    one process per engine, which saves the ~10-30 s of importing vLLM per run on a small machine."""
    work.mkdir(parents=True, exist_ok=True)
    if a.client == "cli":
        out = []
        for job in jobs:
            out.append(_measured(url, lambda job=job: _run_cli(job["cmd"], work / f"{job['name']}.log",
                                                             a.run_timeout_s)))
            bar.update(job["keep"])
        return out
    spec = work / "jobs.json"
    spec.write_text(json.dumps({"url": url, "jobs": [
        {"argv": job["cmd"][job["cmd"].index("serve") + 1:], "name": job["name"]} for job in jobs]}))
    log = work / "client.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client-worker", str(spec)],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + a.run_timeout_s * len(jobs)
        seen = 0
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(2.0)
            finished = sum(1 for job in jobs if job["keep"] and (work / f"{job['name']}.measured.json").exists())
            bar.update(finished - seen)
            seen = finished
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve client failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    bar.update(sum(job["keep"] for job in jobs) - seen)
    return [json.loads((work / f"{job['name']}.measured.json").read_text()) for job in jobs]


def _measured(url: str, run) -> dict:
    """`run()` between two reads of the server's /metrics."""
    from saguaro_vllm.tools.server_process import metric_samples

    def scrape() -> dict[str, float]:
        import urllib.request

        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            return metric_samples(r.read().decode())

    before, load0, t0 = scrape(), os.getloadavg()[0], time.monotonic()
    run()
    wall = time.monotonic() - t0
    time.sleep(1.0)  # the API server records the last steps' spec-decode stats just after answering
    return {"delta": metrics_delta(before, scrape()), "wall_s": round(wall, 1),
            "load": [round(load0, 2), round(os.getloadavg()[0], 2)]}


def _run_cli(cmd: list[str], log: Path, timeout_s: float) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
                              env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def client_worker(spec_path: str) -> None:
    """`--client reuse`: every job's `vllm bench serve` arguments through vLLM's own parser and `main`."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = json.loads(Path(spec_path).read_text())
    for job in spec["jobs"]:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(job["argv"])
        got = _measured(spec["url"], lambda: bench_main(args))
        Path(spec_path).with_name(f"{job['name']}.measured.json").write_text(json.dumps(got))


def _without_note(argv: list[str]) -> list[str]:
    """The command line for the record, the --note text elided (it is stored as `note`)."""
    return [("..." if i and argv[i - 1] == "--note" else x) for i, x in enumerate(argv)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.client_worker:
        client_worker(a.client_worker)
        return 0
    started = time.monotonic()
    pair = None
    if a.target:
        target, draft = a.target, a.draft
        prompts = None
    else:
        from saguaro_vllm.demo.build import ensure_demo_pair

        pair = ensure_demo_pair(cost_matched=a.models == "cost")
        target = str(pair.target_cost if a.models == "cost" else pair.target)
        draft = str(pair.draft_cost if a.models == "cost" else pair.draft)
        prompts = pair.heldout_prompts()
    if "corpus" in a.datasets and not prompts:
        raise SystemExit("--datasets corpus needs the demo pair's held-out prompts (no --target)")
    target_cores = [int(c) for c in a.target_cores.split(",")]
    draft_cores = [int(c) for c in a.draft_cores.split(",")]
    specs = engine_specs(draft, [a.k], a.k, None, target_cores, draft_cores)
    engines = [(e, s) for e, s in specs.items() if engine_family(e) in a.engines]
    date = datetime.datetime.now(datetime.UTC)
    result_dir = RESULTS / "serve" / f"{run_date()}-{a.label}"
    result_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    total = len(engines) * len(a.cases) * len(a.concurrency)
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="saguaro-bench-serve-") as tmp, \
            tqdm(total=total, desc="bench serve runs", dynamic_ncols=True) as bar:
        tmp = Path(tmp)
        corpus = write_corpus_jsonl(prompts, tmp / "corpus.jsonl") if prompts else None
        if corpus:
            (result_dir / "corpus.jsonl").write_text(corpus.read_text())  # the exact prompts, for the record
        for engine, spec in engines:
            runs += serve_engine(engine, spec, engine_pin(engine, a.placement, target_cores), a, target, corpus,
                                 result_dir, tmp, bar)
    out = {
        "kind": "serve", "name": f"serve-{a.label}", "label": a.label, "date": date.isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/bench_serve.py", *_without_note(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(), "note": a.note,
        "load_avg": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
        "target": target, "draft": draft, "models": a.models if pair else "given",
        "placement": {"mode": a.placement, "target_cores": a.target_cores, "draft_cores": a.draft_cores,
                      "rule": "split: vLLM AR and draft_model servers confined whole to target_cores, Saguaro "
                              "pins its worker there and its drafter to draft_cores; equal: vLLM servers "
                              "unpinned; the `vllm bench serve` client unpinned"},
        "settings": {"k": a.k, "concurrency": a.concurrency, "datasets": a.datasets, "temperatures": a.temperatures,
                     "cases": [f"{d}:{t:g}" for d, t in a.cases],
                     "output_len": a.output_len, "random_input_len": a.input_len,
                     "requests": {str(c): num_requests(a, c) for c in a.concurrency}, "seed": a.seed,
                     "max_model_len": a.max_model_len, "corpus_prompts": len(prompts or []), "client": a.client,
                     "kv_cache_gb": kv_cache_gb()},
        "result_dir": str(result_dir.relative_to(ROOT)), "runtime_s": round(time.monotonic() - started, 1),
        "runs": runs, "summary": merge(runs),
    }
    path = RESULTS / f"{run_date()}-serve-{a.label}.json"
    runtime = out["runtime_s"]
    if a.extend:
        path = a.extend
        out = extend_result(json.loads(path.read_text()), out)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({len(runs)} runs, {runtime:.0f} s); vLLM's result JSONs in {result_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
