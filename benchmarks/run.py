"""Side-by-side decode speed: vLLM AR vs vLLM `draft_model` vs Saguaro `sync` (and later `async`).

Every engine runs in its own fresh process (one-process vLLM: front end, engine core and worker together),
on the same prompts, with the same target cores; the Saguaro drafter gets the remaining core(s). Rounds are
interleaved (A B C A B C ...) so machine drift cancels. Results go to `benchmarks/results/<date>-<case>.json`.

    .venv/bin/python benchmarks/run.py --quick                 # demo pair, batch 1, T=0
    .venv/bin/python benchmarks/run.py --models cost --rounds 2 --batch-sizes 1 --max-tokens 256
"""
from __future__ import annotations

import argparse
import datetime
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


def engine_specs(draft: str, k_draft_model: int, k_saguaro: int, saguaro_options: dict | None = None,
                 target_cores: list[int] | None = None, draft_cores: list[int] | None = None,
                 ) -> dict[str, dict | None]:
    placement = {"target_cores": target_cores, "draft_cores": draft_cores} if target_cores else {}
    return {
        "vllm-ar": None,
        "vllm-draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": k_draft_model},
        "saguaro-sync": {"method": "saguaro", "model": draft, "num_speculative_tokens": k_saguaro,
                         "saguaro": {"mode": "sync", "log_interval_s": 0, **placement}},
        "saguaro-async": {"method": "saguaro", "model": draft, "num_speculative_tokens": k_saguaro,
                          "saguaro": {"mode": "async", "log_interval_s": 0, **placement,
                                      **(saguaro_options or {})}},
    }


def run_one(target: str, spec: dict | None, prompts: list[str], batch: int, temperature: float,
            max_tokens: int, pin: list[int] | None, timeout_s: float) -> dict:
    """One engine in a fresh process; `pin`: the cores the whole engine process is confined to (the
    Saguaro drafter, its child, moves itself to its own cores), None: all cores."""
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


def worker(req_path: str, out_path: str) -> None:
    """Inside the engine process: warm up, then time batches of `batch` concurrent requests."""
    r = json.loads(Path(req_path).read_text())
    if r["pin"]:  # before torch and vLLM start any thread: every thread inherits it
        os.sched_setaffinity(0, r["pin"])
    from vllm import LLM, SamplingParams

    llm = LLM(model=r["target"], speculative_config=r["spec"], dtype="float32", enforce_eager=True,
              max_model_len=2048, max_num_seqs=max(r["batch"], 1), disable_log_stats=False,
              distributed_executor_backend="uni", seed=0)
    sp = SamplingParams(temperature=r["temperature"], max_tokens=r["max_tokens"], ignore_eos=True, seed=0)
    llm.generate(r["prompts"][: r["batch"]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)

    def counters():
        c = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
             if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
        return c

    before = counters()
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
    after_saguaro = saguaro_samples()
    sg = {k: v - before_saguaro.get(k, 0.0) for k, v in after_saguaro.items()}
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens", 0)
    dtoks = d.get("vllm:spec_decode_num_draft_tokens", 0)
    Path(out_path).write_text(json.dumps({
        "decode_tok_s_per_seq": statistics.mean(per_seq), "total_tok_s": statistics.mean(totals),
        "ttft_s": statistics.mean(ttfts) if ttfts else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / dtoks if dtoks else None, "drafts": drafts,
        **ssd_figures(sg),
    }))


def saguaro_samples() -> dict[str, float]:
    """Saguaro's Prometheus samples in this (one-process engine) process, labels in the key."""
    import prometheus_client

    out = {}
    for metric in prometheus_client.REGISTRY.collect():
        for s in metric.samples:
            if s.name.startswith("vllm:saguaro"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def ssd_figures(delta: dict[str, float]) -> dict:
    """Hit rate (overall and per accepted depth), backups and pre-draft vs verification time of a run."""
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
            depth = key.split("depth=")[1].rstrip("}")
            by_depth[depth] = total("vllm:saguaro_cache_hits_total", f"depth={depth}}}") / v
    rounds = total("vllm:saguaro_predraft_seconds_count")
    return {
        **out,
        "hit_rate": total("vllm:saguaro_cache_hits_total") / lookups, "hit_rate_by_depth": by_depth,
        "lookups": lookups,
        "backups": {kind: total("vllm:saguaro_backups_total", f"kind={kind}") for kind in ("jit", "ngram")},
        "predraft_ms": 1e3 * total("vllm:saguaro_predraft_seconds_sum") / rounds if rounds else None,
        "verify_ms": 1e3 * total("vllm:saguaro_verify_seconds_sum") / rounds if rounds else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--models", choices=["raw", "cost"], default="raw",
                   help="demo pair: raw trained models or their cost-matched versions")
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--engines", default="vllm-ar,vllm-draft_model,saguaro-sync,saguaro-async")
    p.add_argument("--saguaro-options", default="{}", help="extra `saguaro` options (JSON) for saguaro-async")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--k", type=int, default=5, help="K for Saguaro")
    p.add_argument("--k-draft-model", type=int, default=5, help="K for vLLM draft_model")
    p.add_argument("--target-cores", default="0", help="cores of the target in every engine (split placement)")
    p.add_argument("--draft-cores", default="1", help="cores of the Saguaro drafter")
    p.add_argument("--placement", choices=["split", "equal"], default="split",
                   help="split: every engine's target on --target-cores, the drafter on --draft-cores; "
                        "equal: vLLM AR and draft_model use all cores (equal total cores)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 64 tokens")
    p.add_argument("--timeout", type=float, default=1200)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    if a.quick:
        a.num_prompts, a.max_tokens = 2, 64
    from saguaro_vllm.demo.build import ensure_demo_pair

    pair = None
    if not (a.target and a.draft):
        pair = ensure_demo_pair(cost_matched=a.models == "cost")
    target = a.target or str(pair.target_cost if a.models == "cost" else pair.target)
    draft = a.draft or str(pair.draft_cost if a.models == "cost" else pair.draft)
    prompts = pair.heldout_prompts(a.num_prompts * 16)[: a.num_prompts * 16] if pair else ["def main():"] * 64
    target_cores = [int(c) for c in a.target_cores.split(",")]
    draft_cores = [int(c) for c in a.draft_cores.split(",")]
    specs = engine_specs(draft, a.k_draft_model, a.k, json.loads(a.saguaro_options), target_cores, draft_cores)
    engines = a.engines.split(",")
    cases = [(b, t) for b in map(int, a.batch_sizes.split(",")) for t in map(float, a.temperatures.split(","))]
    results = []
    jobs = [(rnd, b, t, e) for rnd in range(a.rounds) for (b, t) in cases for e in engines]
    for rnd, b, t, e in tqdm(jobs, desc="engine runs"):
        # Saguaro engines pin their target worker themselves (saguaro_vllm/placement.py) to target_cores.
        pin = target_cores if (a.placement == "split" and e.startswith("vllm-")) else None
        res = run_one(target, specs[e], prompts[: a.num_prompts * b], b, t, a.max_tokens, pin, a.timeout)
        results.append({"engine": e, "round": rnd, "batch": b, "temperature": t, **res})
        hit = f", hit rate {res['hit_rate']:.3f}" if res.get("hit_rate") is not None else ""
        tqdm.write(f"{e:18s} batch={b} T={t}: {res['decode_tok_s_per_seq']:.1f} tok/s/seq, "
                   f"accept len {res['mean_acceptance_length']}{hit}")
    summary = {}
    for e in engines:
        for b, t in cases:
            rows = [r for r in results if r["engine"] == e and r["batch"] == b and r["temperature"] == t]
            summary[f"{e}|b{b}|T{t}"] = {k: statistics.mean(r[k] for r in rows) if rows[0][k] is not None
                                         else None for k in ("decode_tok_s_per_seq", "total_tok_s",
                                                             "mean_acceptance_length", "acceptance_rate")}
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "target": target, "draft": draft, "placement": a.placement, "target_cores": target_cores,
        "draft_cores": draft_cores, "max_tokens": a.max_tokens,
        "k": a.k, "k_draft_model": a.k_draft_model, "results": results, "summary": summary}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{datetime.date.today()}-{a.models}-b{a.batch_sizes.replace(',', '_')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"\n{'engine':18s} {'case':10s} {'tok/s/seq':>10s} {'accept len':>10s}")
    for key, s in summary.items():
        e, b, t = key.split("|")
        acc = f"{s['mean_acceptance_length']:.2f}" if s["mean_acceptance_length"] else "-"
        print(f"{e:18s} {b + ' ' + t:10s} {s['decode_tok_s_per_seq']:10.2f} {acc:>10s}")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
