"""Side by side: vLLM AR, vLLM `draft_model`, Saguaro `sync` and Saguaro `async` (SSD) on the same prompts.

Every engine runs in its own fresh process (one-process vLLM: front end, engine core and worker together),
rounds interleaved (A B C D A B C D ...) so machine drift cancels. Placement (stated in every result):
- `split` (default, the paper's setting): every engine's target on `--target-cores`; vLLM engines get the
  whole engine process pinned there, Saguaro engines pin their worker themselves (saguaro_vllm/shared/placement.py)
  and the drafter runs on `--draft-cores`;
- `equal`: vLLM AR and `draft_model` may use every core (equal total cores); Saguaro as in `split`.
Results go to `benchmarks/results/<date>-<name>.json`; `benchmarks/report.py` turns them into
`docs/benchmarks.md` and plots.

    .venv/bin/python benchmarks/run.py --quick                       # ~3-minute smoke run
    .venv/bin/python benchmarks/run.py --name b1-t0 --batch-sizes 1 --temperatures 0
    .venv/bin/python benchmarks/run.py --sweep --name sweep-c --temperatures 1 --sweep-scale 1,0.5,0.25
    saguaro-vllm bench --quick                                       # the same script

`SAGUARO_BENCH_KEEP_LOG=FILE` keeps the last engine's log (vLLM's and the drafter's output) in FILE.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

RESULTS = Path(__file__).resolve().parent / "results"


def run_date() -> str:
    """The date that names a result file: `BENCH_DATE` where set (`make bench` sets it once, so the files
    one step writes and a later step reads keep the date the run started, past midnight too), else today's."""
    return os.environ.get("BENCH_DATE") or datetime.date.today().isoformat()


# ------------------------------------------------------------------------------------------- engines

def engine_specs(draft: str, k_draft_model: list[int], k_saguaro: int, saguaro_options: dict | None = None,
                 target_cores: list[int] | None = None, draft_cores: list[int] | None = None,
                 ) -> dict[str, dict | None]:
    """Engine name -> speculative config (None: AR). `vllm-draft_model-k<K>` for each K tried."""
    placement = {"target_cores": target_cores, "draft_cores": draft_cores} if target_cores else {}
    specs: dict[str, dict | None] = {"vllm-ar": None}
    for k in k_draft_model:
        specs[f"vllm-draft_model-k{k}"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    specs["saguaro-sync"] = {"method": "saguaro", "model": draft, "num_speculative_tokens": k_saguaro,
                             "saguaro": {"mode": "sync", "log_interval_s": 0, **placement}}
    specs["saguaro-async"] = {"method": "saguaro", "model": draft, "num_speculative_tokens": k_saguaro,
                              "saguaro": {"mode": "async", "log_interval_s": 0, **placement,
                                          **(saguaro_options or {})}}
    return specs


def engine_family(engine: str) -> str:
    """`vllm-draft_model-k5` -> `vllm-draft_model` (the row the report shows, at its best K)."""
    return engine.rsplit("-k", 1)[0] if engine.startswith("vllm-draft_model-k") else engine


def engine_pin(engine: str, placement: str, target_cores: list[int]) -> list[int] | None:
    """The cores a whole engine process is confined to (None: unpinned). `split`: vLLM engines on the
    target's cores; Saguaro engines are never pinned whole (they pin their worker to `target_cores` and the
    drafter to `draft_cores` themselves). `equal`: nothing pinned."""
    return target_cores if (engine.startswith("vllm-") and placement == "split") else None


def run_one(target: str, spec: dict | None, prompts: list[str], batch: int, temperature: float,
            max_tokens: int, pin: list[int] | None, timeout_s: float) -> dict:
    """One engine in a fresh process; `pin`: the cores the whole engine process is confined to (None: all)."""
    request = {"target": target, "spec": spec, "prompts": prompts, "batch": batch,
               "temperature": temperature, "max_tokens": max_tokens, "pin": pin}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        req, out, log = Path(tmp, "req.json"), Path(tmp, "out.json"), Path(tmp, "log")
        req.write_text(json.dumps(request))
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, __file__, "--worker", str(req), str(out)], env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"engine failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if os.environ.get("SAGUARO_BENCH_KEEP_LOG"):
            Path(os.environ["SAGUARO_BENCH_KEEP_LOG"]).write_text(log.read_text())
        return json.loads(out.read_text())


# -------------------------------------------------------------------------------- inside the engine

def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory (VmHWM) of this engine process and of its child processes (the drafter)."""
    import psutil

    def hwm(pid: int) -> float | None:
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    out = {"engine": hwm(os.getpid()) or 0.0}
    for child in psutil.Process().children(recursive=True):
        mb = hwm(child.pid)
        if mb is not None and "saguaro_vllm.drafter.server" in " ".join(child.cmdline()):
            out["drafter"] = mb
    return out


def worker(req_path: str, out_path: str) -> None:
    """Inside the engine process: warm up, then time groups of `batch` concurrent requests."""
    r = json.loads(Path(req_path).read_text())
    if r["pin"]:  # before torch and vLLM start any thread: every thread inherits it
        os.sched_setaffinity(0, r["pin"])
    from vllm import LLM, SamplingParams

    from saguaro_vllm.worker.metrics import saguaro_samples

    llm = LLM(model=r["target"], speculative_config=r["spec"], dtype="float32", enforce_eager=True,
              max_model_len=2048, max_num_seqs=max(r["batch"], 1), disable_log_stats=False,
              distributed_executor_backend="uni", seed=0)
    sp = SamplingParams(temperature=r["temperature"], max_tokens=r["max_tokens"], ignore_eos=True, seed=0)
    llm.generate(r["prompts"][: r["batch"]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)

    def counters():
        return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}

    def per_pos():
        return next((list(m.values) for m in llm.get_metrics()
                     if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos" and hasattr(m, "values")), [])

    before = counters()
    before_pos = per_pos()
    before_saguaro = saguaro_samples()
    per_seq, totals, ttfts = [], [], []
    prompts = r["prompts"]
    for i in range(0, len(prompts) - r["batch"] + 1, r["batch"]):
        group = prompts[i: i + r["batch"]]
        t0 = time.perf_counter()
        outs = llm.generate(group, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        for o in outs:
            m, n = o.metrics, len(o.outputs[0].token_ids)
            if m is not None and m.last_token_ts > m.first_token_ts > 0:
                ttfts.append(m.first_token_latency)
                per_seq.append((n - 1) / (m.last_token_ts - m.first_token_ts))
            else:
                per_seq.append(n / dt)
        totals.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
    after = counters()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    after_pos = per_pos()
    pos = [a - (before_pos[i] if i < len(before_pos) else 0) for i, a in enumerate(after_pos)]
    after_saguaro = saguaro_samples()
    sg = {k: v - before_saguaro.get(k, 0.0) for k, v in after_saguaro.items()}
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens", 0)
    dtoks = d.get("vllm:spec_decode_num_draft_tokens", 0)
    Path(out_path).write_text(json.dumps({
        "decode_tok_s_per_seq": statistics.mean(per_seq), "total_tok_s": statistics.mean(totals),
        "per_seq_tok_s": per_seq,  # per request, in prompt order: pairs with other engines' for intervals
        "ttft_s": statistics.mean(ttfts) if ttfts else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / dtoks if dtoks else None, "drafts": drafts,
        "accepted_per_pos": pos, "per_token_acceptance": per_token_acceptance(drafts, pos),
        "peak_memory_mb": peak_memory_mb(),
        **ssd_figures(sg),
    }))


def per_token_acceptance(drafts: float, accepted_per_pos: list[float]) -> float | None:
    """P(accept a draft token | every earlier one of its draft was accepted): the per-token rate `a` of
    `(1 - a^(K+1)) / (1 - a)`. Position i is reached by the drafts that accepted positions < i, so this is
    sum_i accepted[i] / (drafts + sum_{i<K-1} accepted[i]); exact for engines that always draft K tokens
    (vLLM `draft_model`), a lower bound where some drafts are shorter."""
    if not drafts or not accepted_per_pos:
        return None
    return sum(accepted_per_pos) / (drafts + sum(accepted_per_pos[:-1]))


def ssd_figures(delta: dict[str, float]) -> dict:
    """Drafter wait and compute per step; for SSD also the hit rate (overall and per accepted depth),
    backups and pre-draft vs verification time of a run."""
    def total(name: str, label: str | None = None) -> float:
        return sum(v for k, v in delta.items()
                   if k.split("{")[0] == name and (label is None or label in k))

    out = {}
    steps = total("vllm:saguaro_drafter_step_seconds_count")
    if steps:  # the proposer's wait for the drafter (critical path) and the drafter's compute, per step
        out["drafter_wait_ms"] = 1e3 * total("vllm:saguaro_drafter_step_seconds_sum") / steps
        out["drafter_compute_ms"] = 1e3 * total("vllm:saguaro_drafter_compute_seconds_sum") / steps
    lookups = total("vllm:saguaro_cache_lookups_total")
    if not lookups:
        return out
    by_depth = {}
    for key, v in delta.items():
        if key.startswith("vllm:saguaro_cache_lookups_total{") and v:
            label = key[key.index("{"):]  # {depth="3"}
            by_depth[label.split('"')[1]] = total("vllm:saguaro_cache_hits_total", label) / v
    rounds = total("vllm:saguaro_predraft_seconds_count")
    return {
        **out,
        "hit_rate": total("vllm:saguaro_cache_hits_total") / lookups, "hit_rate_by_depth": by_depth,
        "lookups": lookups,
        "backups": {kind: total("vllm:saguaro_backups_total", f'kind="{kind}"') for kind in ("jit", "ngram")},
        "predraft_ms": 1e3 * total("vllm:saguaro_predraft_seconds_sum") / rounds if rounds else None,
        "verify_ms": 1e3 * total("vllm:saguaro_verify_seconds_sum") / rounds if rounds else None,
        "late_ms": 1e3 * total("vllm:saguaro_late_seconds_sum") / rounds if rounds else None,
        "predraft_skipped": total("vllm:saguaro_predraft_skipped_total"),
    }


# ------------------------------------------------------------------------------------------ driver

def machine_info() -> dict:
    import importlib.metadata as md

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    versions = {}
    for dist in ("vllm", "torch", "saguaro-vllm"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE")
            * os.sysconf("SC_PHYS_PAGES") / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--case", help="a named case of benchmarks/cases.json (its options; other flags override)")
    p.add_argument("--name", help="result name: benchmarks/results/<date>-<name>.json (default from the case)")
    p.add_argument("--models", choices=["raw", "cost"], default="cost",
                   help="demo pair: its cost-matched models (default) or the raw trained ones")
    p.add_argument("--target", help="any Hugging Face model directory (instead of the demo pair)")
    p.add_argument("--draft", help="draft model directory for --target")
    p.add_argument("--engines", default="vllm-ar,vllm-draft_model,saguaro-sync,saguaro-async")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--temperatures", default="0,0.7,1.0")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=2, help="groups of `batch` requests per run")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions of every run")
    p.add_argument("--k", type=int, default=5, help="K for Saguaro")
    p.add_argument("--k-draft-model", default="3,5", help="Ks tried for vLLM draft_model (best reported)")
    p.add_argument("--saguaro-options", default="{}", help="extra `saguaro` options (JSON) for saguaro-async")
    p.add_argument("--target-cores", default="0", help="cores of the target in every engine")
    p.add_argument("--draft-cores", default="1", help="cores of the Saguaro drafter")
    p.add_argument("--placement", choices=["split", "equal"], default="split",
                   help="split: every target on --target-cores; equal: vLLM AR and draft_model use all cores")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 1, T=0, 1 prompt, 48 tokens, K=5")
    p.add_argument("--sweep", action="store_true",
                   help="sweep Saguaro async over --sweep-k x --sweep-budget x --sweep-scale (no other engines)")
    p.add_argument("--sweep-k", default="5")
    p.add_argument("--sweep-budget", default="auto", help="fanout_budget values ('auto' = sized from timings)")
    p.add_argument("--sweep-scale", default="1", help="sampling_scale (C) values")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    if args.case:
        cases = json.loads((Path(__file__).resolve().parent / "cases.json").read_text())
        if args.case not in cases or args.case.startswith("_"):
            p.error(f"--case {args.case!r}: not in benchmarks/cases.json "
                    f"({', '.join(k for k in cases if not k.startswith('_'))})")
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in (argv or sys.argv[1:]) if a.startswith("--")}
        for key, value in cases[args.case].items():
            if key not in given:
                setattr(args, key, value)
        args.name = args.name or args.case
    return args


def build_runs(a: argparse.Namespace, draft: str) -> list[dict]:
    """Every (round, case, engine) run, interleaved: all engines of a case within each round."""
    target_cores = [int(c) for c in a.target_cores.split(",")]
    draft_cores = [int(c) for c in a.draft_cores.split(",")]
    cases = [(b, t) for b in map(int, a.batch_sizes.split(",")) for t in map(float, a.temperatures.split(","))]
    options = json.loads(a.saguaro_options)
    if a.sweep:
        variants = []
        for k, budget, scale in itertools.product(a.sweep_k.split(","), a.sweep_budget.split(","),
                                                  a.sweep_scale.split(",")):
            opts = {**options, "sampling_scale": float(scale)}
            if budget != "auto":
                opts["fanout_budget"] = int(budget)
            spec = engine_specs(draft, [], int(k), opts, target_cores, draft_cores)["saguaro-async"]
            variants.append((f"saguaro-async[k={k},budget={budget},C={scale}]", spec,
                             {"k": int(k), "budget": budget, "scale": float(scale)}))
    else:
        specs = engine_specs(draft, [int(k) for k in a.k_draft_model.split(",")], a.k, options,
                             target_cores, draft_cores)
        wanted = a.engines.split(",")
        variants = [(e, s, None) for e, s in specs.items() if engine_family(e) in wanted]
    runs = []
    for rnd, (b, t), (name, spec, sweep) in itertools.product(range(a.rounds), cases, variants):
        pin = engine_pin(name, a.placement, target_cores)
        runs.append({"engine": name, "round": rnd, "batch": b, "temperature": t, "spec": spec, "pin": pin,
                     **({"sweep": sweep} if sweep else {})})
    return runs


def summarize(results: list[dict]) -> dict[str, dict]:
    """Mean over rounds per (engine, batch, temperature)."""
    keys = ("decode_tok_s_per_seq", "total_tok_s", "ttft_s", "mean_acceptance_length", "acceptance_rate",
            "hit_rate", "predraft_ms", "verify_ms", "drafter_wait_ms")
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(f"{r['engine']}|b{r['batch']}|T{r['temperature']}", []).append(r)
    out = {}
    for key, rows in groups.items():
        out[key] = {k: statistics.mean(r[k] for r in rows) if all(r.get(k) is not None for r in rows) else None
                    for k in keys}
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    if a.quick:
        a.batch_sizes, a.temperatures, a.num_prompts, a.max_tokens, a.k_draft_model = "1", "0", 1, 48, "5"
        a.name = a.name or "quick"
    pair = None
    if not (a.target and a.draft):
        from saguaro_vllm.demo.build import ensure_demo_pair

        pair = ensure_demo_pair(cost_matched=a.models == "cost")
    target = a.target or str(pair.target_cost if a.models == "cost" else pair.target)
    draft = a.draft or str(pair.draft_cost if a.models == "cost" else pair.draft)
    max_batch = max(map(int, a.batch_sizes.split(",")))
    prompts = pair.heldout_prompts(a.num_prompts * max_batch) if pair else ["def main():"] * (a.num_prompts * max_batch)
    runs = build_runs(a, draft)
    name = a.name or f"{a.models if pair else 'custom'}-{a.placement}" + ("-sweep" if a.sweep else "")
    results = []
    for run in tqdm(runs, desc="engine runs"):
        res = run_one(target, run["spec"], prompts[: a.num_prompts * run["batch"]], run["batch"],
                      run["temperature"], a.max_tokens, run["pin"], a.timeout)
        results.append({k: v for k, v in run.items() if k != "spec"} | {"config": run["spec"]} | res)
        hit = f", hit rate {res['hit_rate']:.3f}" if res.get("hit_rate") is not None else ""
        acc = res["mean_acceptance_length"]
        tqdm.write(f"{run['engine']:40s} batch={run['batch']:<2d} T={run['temperature']}: "
                   f"{res['decode_tok_s_per_seq']:.2f} tok/s/seq"
                   f"{f', accept len {acc:.2f}' if acc else ''}{hit}")
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "name": name, "machine": machine_info(),
        "target": target, "draft": draft, "models": a.models if pair else "custom",
        "demo_pair_stats": pair.stats if pair else None,
        "placement": {"mode": a.placement, "target_cores": a.target_cores, "draft_cores": a.draft_cores,
                      "rule": "split: every engine's target on target_cores (vLLM engines pinned whole, "
                              "Saguaro pins its worker), Saguaro drafter on draft_cores; equal: vLLM AR "
                              "and draft_model use all cores"},
        "max_tokens": a.max_tokens, "num_prompts": a.num_prompts, "rounds": a.rounds, "k": a.k,
        "k_draft_model": a.k_draft_model, "sweep": a.sweep, "command": " ".join(sys.argv),
        "results": results, "summary": summarize(results),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{run_date()}-{name}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\n{'engine':40s} {'case':10s} {'tok/s/seq':>10s} {'accept len':>10s} {'hit rate':>9s}")
    for key, s in out["summary"].items():
        e, b, t = key.split("|")
        acc = f"{s['mean_acceptance_length']:.2f}" if s["mean_acceptance_length"] else "-"
        hit = f"{s['hit_rate']:.3f}" if s["hit_rate"] is not None else "-"
        print(f"{e:40s} {b + ' ' + t:10s} {s['decode_tok_s_per_seq']:10.2f} {acc:>10s} {hit:>9s}")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
