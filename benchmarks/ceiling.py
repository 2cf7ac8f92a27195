"""The depth ceiling at batch 1, T=0 (issue 14 item 2): SSD at fixed K against SSD with `depth: "auto"`
and against a free, perfect drafter at the same K (`oracle_proposer.py`: the target's own greedy tokens).

1. plain vLLM records the target's greedy continuation of every prompt (prompt + output token ids);
2. rounds of: the oracle at each K in `--oracle-k` (every draft accepted, no drafting time: the ceiling a
   real drafter at that K cannot pass), Saguaro `async` at `--k`, and Saguaro `async` with `depth: "auto"`
   up to `--max-depth`. Target on core 0 for every engine, the Saguaro drafter on core 1.
Writes `benchmarks/results/<date>-ceiling.json`; `benchmarks/report.py` puts the table on docs/benchmarks.md.

    .venv/bin/python benchmarks/ceiling.py                       # K=5, auto up to 8, 2 prompts x 128 tokens
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import RESULTS, engine_specs, machine_info, run_date, run_one  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", type=int, default=5, help="Saguaro's fixed K")
    p.add_argument("--max-depth", type=int, default=8, help="num_speculative_tokens of the depth-auto run")
    p.add_argument("--oracle-k", default="5,8", help="Ks of the perfect drafter")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--record", nargs=2, metavar=("REQUEST", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def record(req_path: str, out_path: str) -> None:
    """Inside a fresh process: the target's greedy token ids (prompt + output) with run.py's engine settings."""
    r = json.loads(Path(req_path).read_text())
    os.sched_setaffinity(0, [0])
    from vllm import LLM, SamplingParams

    llm = LLM(model=r["target"], dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1,
              distributed_executor_backend="uni", seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True)
    seqs = []
    for prompt in r["prompts"]:
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        seqs.append(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
    Path(out_path).write_text(json.dumps(seqs))


def record_greedy(target: str, prompts: list[str], max_tokens: int) -> str:
    """Record the target's greedy continuations (in a fresh process) for `oracle_proposer.py`; returns the
    JSON file's path. `max_tokens` should exceed the measured runs' by the largest K, for the last drafts."""
    tmp = Path(tempfile.mkdtemp(prefix="saguaro-oracle-"))
    req, out = tmp / "record.json", tmp / "greedy.json"
    req.write_text(json.dumps({"target": target, "prompts": prompts, "max_tokens": max_tokens}))
    print("[oracle] recording the target's greedy continuations", flush=True)
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--record", str(req), str(out)], check=True,
                   env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return str(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.record:
        record(*a.record)
        return 0
    from saguaro_vllm.demo.build import ensure_demo_pair

    pair = ensure_demo_pair(cost_matched=True)
    target, draft = str(pair.target_cost), str(pair.draft_cost)
    prompts = pair.heldout_prompts(a.num_prompts)
    oracle_ks = [int(k) for k in a.oracle_k.split(",")]
    os.environ["SAGUARO_ORACLE_TOKENS"] = record_greedy(target, prompts,
                                                        a.max_tokens + max(oracle_ks + [a.max_depth]) + 2)

    engines = {f"oracle-k{k}": ({"method": "custom_class", "model": "oracle_proposer.OracleProposer",
                                 "num_speculative_tokens": k}, [0]) for k in oracle_ks}
    engines[f"saguaro-async-k{a.k}"] = (engine_specs(draft, [], a.k, {}, [0], [1])["saguaro-async"], None)
    engines[f"saguaro-async-depth-auto-k{a.max_depth}"] = (
        engine_specs(draft, [], a.max_depth, {"depth": "auto"}, [0], [1])["saguaro-async"], None)
    results = []
    runs = [(rnd, name) for rnd in range(a.rounds) for name in engines]
    for rnd, name in tqdm(runs, desc="ceiling runs"):
        spec, pin = engines[name]
        res = run_one(target, spec, prompts, 1, 0.0, a.max_tokens, pin, a.timeout)
        results.append({"engine": name, "round": rnd, **res})
        tqdm.write(f"{name:34s} round {rnd}: {res['decode_tok_s_per_seq']:.2f} tok/s/seq, accept len "
                   f"{res['mean_acceptance_length'] or 0:.2f}")
    summary = {}
    for name in engines:
        rows = [r for r in results if r["engine"] == name]
        per_seq = [v for r in rows for v in r["per_seq_tok_s"]]
        summary[name] = {"tok_s_per_seq": statistics.mean(per_seq), "per_seq_tok_s": per_seq,
                         "mean_acceptance_length": statistics.mean(r["mean_acceptance_length"] or 0 for r in rows),
                         "hit_rate": statistics.mean(r.get("hit_rate") or 0 for r in rows),
                         "verify_ms": statistics.mean(r["verify_ms"] for r in rows) if all(r.get("verify_ms") for r in rows) else None}
    out = {"kind": "ceiling", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": machine_info(), "target": target, "draft": draft, "k": a.k, "max_depth": a.max_depth,
           "oracle_k": oracle_ks, "max_tokens": a.max_tokens, "num_prompts": a.num_prompts, "rounds": a.rounds,
           "command": " ".join(sys.argv), "placement": "target on core 0; Saguaro drafter on core 1; the oracle "
           "has no drafter", "results": results, "summary": summary}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{run_date()}-ceiling.json"
    path.write_text(json.dumps(out, indent=1))
    for name, s in summary.items():
        print(f"{name:34s} {s['tok_s_per_seq']:8.2f} tok/s/seq  accept len {s['mean_acceptance_length']:.2f}")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
