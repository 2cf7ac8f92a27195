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


def engine_specs(draft: str, k_draft_model: int, k_saguaro: int) -> dict[str, dict | None]:
    return {
        "vllm-ar": None,
        "vllm-draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": k_draft_model},
        "saguaro-sync": {"method": "saguaro", "model": draft, "num_speculative_tokens": k_saguaro,
                         "saguaro": {"mode": "sync", "log_interval_s": 0}},
    }


def run_one(target: str, spec: dict | None, prompts: list[str], batch: int, temperature: float,
            max_tokens: int, target_cores: str, timeout_s: float) -> dict:
    request = {"target": target, "spec": spec, "prompts": prompts, "batch": batch,
               "temperature": temperature, "max_tokens": max_tokens}
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": target_cores, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
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
        return json.loads(out.read_text())


def worker(req_path: str, out_path: str) -> None:
    """Inside the engine process: warm up, then time batches of `batch` concurrent requests."""
    from vllm import LLM, SamplingParams

    r = json.loads(Path(req_path).read_text())
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
    drafts = d.get("vllm:spec_decode_num_drafts", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens", 0)
    dtoks = d.get("vllm:spec_decode_num_draft_tokens", 0)
    Path(out_path).write_text(json.dumps({
        "decode_tok_s_per_seq": statistics.mean(per_seq), "total_tok_s": statistics.mean(totals),
        "ttft_s": statistics.mean(ttfts) if ttfts else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / dtoks if dtoks else None, "drafts": drafts,
    }))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--models", choices=["raw", "cost"], default="raw",
                   help="demo pair: raw trained models or their cost-matched versions")
    p.add_argument("--target"), p.add_argument("--draft")
    p.add_argument("--engines", default="vllm-ar,vllm-draft_model,saguaro-sync")
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--k", type=int, default=5, help="K for Saguaro")
    p.add_argument("--k-draft-model", type=int, default=5, help="K for vLLM draft_model")
    p.add_argument("--target-cores", default="0")
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
    specs = engine_specs(draft, a.k_draft_model, a.k)
    engines = a.engines.split(",")
    cases = [(b, t) for b in map(int, a.batch_sizes.split(",")) for t in map(float, a.temperatures.split(","))]
    results = []
    jobs = [(rnd, b, t, e) for rnd in range(a.rounds) for (b, t) in cases for e in engines]
    for rnd, b, t, e in tqdm(jobs, desc="engine runs"):
        res = run_one(target, specs[e], prompts[: a.num_prompts * b], b, t, a.max_tokens, a.target_cores,
                      a.timeout)
        results.append({"engine": e, "round": rnd, "batch": b, "temperature": t, **res})
        tqdm.write(f"{e:18s} batch={b} T={t}: {res['decode_tok_s_per_seq']:.1f} tok/s/seq, "
                   f"accept len {res['mean_acceptance_length']}")
    summary = {}
    for e in engines:
        for b, t in cases:
            rows = [r for r in results if r["engine"] == e and r["batch"] == b and r["temperature"] == t]
            summary[f"{e}|b{b}|T{t}"] = {k: statistics.mean(r[k] for r in rows) if rows[0][k] is not None
                                         else None for k in ("decode_tok_s_per_seq", "total_tok_s",
                                                             "mean_acceptance_length", "acceptance_rate")}
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": {
        "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "target": target, "draft": draft, "target_cores": a.target_cores, "max_tokens": a.max_tokens,
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
