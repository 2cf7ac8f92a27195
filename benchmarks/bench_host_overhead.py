"""The drafter's host overhead: what its Python, bookkeeping and device syncs cost per answer, glue, branch
step and jit step, with a compute-free draft, so the time measured is the host's (issue 28 item 6).

On a GPU a 1B draft's forward is ~1 ms of device time; whatever the host adds on top (building chunks and
block tables, candidate selection, forks, per-row bookkeeping, device-to-host transfers) is paid on every
forward and, in the answer, on the critical path. Here the draft is a 1-layer Llama of hidden 16 (its compute
is negligible): with vocabulary 256 for greedy rounds, and the real 128256 where the sampler is involved
(T=1: q' over the whole vocabulary is real work on a CPU, device work on a GPU, so T=1 figures are upper
bounds of the host part). Per (batch, budget, temperature), averaged over rounds in one process:

- `answer_ms`: `SSDDrafter.step` when every row hits (lookups, adoption, publishing);
- `glue_ms`: the pre-draft's first forward (glue), with the deferred freeing of the last round's branches;
- `branch_step_ms`: each later pre-draft forward (one step over batch x budget branches); the first of a
  round also selects the candidates and admits the branches (forks), so a round's admission is spread over
  its steps in this mean;
- `jit_ms`: per forward of an answer whose rows all miss (drafted just in time);
- `transfers_per_forward`: `.item/.tolist/int/bool/.cpu` calls (device-to-host transfers on a GPU) per
  forward over the whole round (tests/sync_count.py);
- `*_model_ms`: of each of the above, the time inside the draft model's forward and LM head (its kernels: on
  a GPU device work, not host time; here the CPU runs them, ~2.4 ms for 2048 one-token rows even at hidden
  16), and `*_host_ms` the rest: what the drafter's own code adds, the figure the issue's goals are about.

    .venv/bin/python benchmarks/bench_host_overhead.py                       # batches 1,16,64 x budgets 0,8,32
    .venv/bin/python benchmarks/bench_host_overhead.py --trees before=/tmp/before,after=.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path(os.environ.get("SAGUARO_CACHE", Path.home() / ".cache" / "saguaro-vllm")) / "bench-host"
K = 5


def build_model(vocab: int) -> Path:
    path = CACHE / f"llama-h16-l1-v{vocab}"
    if (path / "model.safetensors").exists():
        return path
    sys.path.insert(0, str(ROOT / "tests"))
    from distribution import build_tiny_llama

    return build_tiny_llama(path, vocab_size=vocab, num_layers=1, hidden_size=16, num_heads=1)


def measure(model_path: str, batch: int, budget: int, temperature: float, rounds: int) -> dict:
    """One configuration in this process (the tree on sys.path decides which code runs)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from sync_count import CountTransfers

    from saguaro_vllm.drafter.kv_cache import KVCacheConfig
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.shared.proposal_buffers import ProposalRing
    from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

    torch.set_num_threads(1)
    model = load_draft_model(model_path, dtype=torch.float32, device="cpu")
    vocab = model.config.vocab_size
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=16384, block_size=16))
    options = {"backup": "jit", "fanout_budget": budget} if budget else {"backup": "jit", "fanout": [0] * (K + 1)}
    drafter = SSDDrafter(runner, vocab_size=vocab, options=options)
    ring = ProposalRing.create(rows=batch, k=K, vocab=vocab)
    drafter.probs_ring = ring
    import gc

    gc.collect()
    gc.freeze()  # as the drafter server does once loaded (drafter/server.py)
    from device_rounds import count_forwards  # tests/, put on sys.path above

    forwards = count_forwards(runner)
    model_s = [0.0]  # seconds inside the model's forward and LM head (kernels: device work on a GPU)

    def timed(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                model_s[0] += time.perf_counter() - t0
        return run

    model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
    rng = np.random.default_rng(0)
    spec = SamplingSpec() if temperature == 0 else SamplingSpec(temperature=temperature, seed=1)
    ctx = {f"r{i}": rng.integers(2, vocab - 2, 24).tolist() for i in range(batch)}
    resp = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, K, spec) for r, c in ctx.items()], []))
    sums = {"answer": [], "glue": [], "branch_step": [], "jit": []}
    inside = {name: [] for name in sums}  # the model's share of each
    transfers = fwd_total = 0
    step = 1
    for rnd in range(rounds):
        ring.release_held()
        drafter.answered()
        first = True
        with CountTransfers() as count:
            forwards[0] = 0
            while drafter.busy:
                before, m0 = forwards[0], model_s[0]
                t0 = time.perf_counter()
                drafter.advance()
                dt = time.perf_counter() - t0
                if forwards[0] > before:
                    sums["glue" if first else "branch_step"].append(dt)
                    inside["glue" if first else "branch_step"].append(model_s[0] - m0)
                    first = False
            fwd_total += forwards[0]
            rows, hit = [], rnd % 2 == 0 or not budget  # alternate all-hit and all-miss answers
            for j, (rid, c) in enumerate(ctx.items()):
                cached = {t for d, t in drafter.cache.outcomes(rid) if d == len(resp.drafts[j])}
                bonus = (min(cached) if hit and cached else
                         next(t for t in range(2, vocab) if t not in cached))
                rows.append(RowUpdate(rid, len(c), resp.drafts[j] + [bonus], K))
                ctx[rid] = c + resp.drafts[j] + [bonus]
            step += 1
            forwards[0], m0 = 0, model_s[0]
            t0 = time.perf_counter()
            resp = drafter.step(StepRequest(step, rows, []))
            dt = time.perf_counter() - t0
            fwd_total += forwards[0]
            if forwards[0]:
                sums["jit"].append(dt / forwards[0])
                inside["jit"].append((model_s[0] - m0) / forwards[0])
            elif "hit" in resp.row_status:
                sums["answer"].append(dt)
                inside["answer"].append(model_s[0] - m0)
        transfers += count.total
    ring.close()
    out = {"batch": batch, "budget": budget, "temperature": temperature, "vocab": vocab, "rounds": rounds,
           "transfers_per_forward": transfers / max(fwd_total, 1)}
    for name, values in sums.items():
        out[f"{name}_ms"] = 1e3 * sum(values) / len(values) if values else None
        model_ms = 1e3 * sum(inside[name]) / len(values) if values else None
        out[f"{name}_model_ms"] = model_ms
        out[f"{name}_host_ms"] = out[f"{name}_ms"] - model_ms if values else None
    return out


def run_tree(tree: tuple[str, str] | None, args) -> list[dict]:
    """Every configuration in a fresh process per tree (PYTHONPATH: the tree's saguaro_vllm first)."""
    env = dict(os.environ)
    cwd = None
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree[1], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cwd = tree[1]
    jobs = [(b, m, t) for t in args.temperatures for b in args.batches for m in args.budgets]
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp, "req.json")
        req.write_text(json.dumps({"jobs": jobs, "rounds": args.rounds,
                                   "models": {str(t): str(build_model(args.sampled_vocab if t else args.vocab))
                                              for t in args.temperatures}}))
        out = Path(tmp, "out.json")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(req), str(out)],
                              env=env, cwd=cwd, check=False, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"tree {tree}: {proc.stderr[-3000:]}")
        rows = json.loads(out.read_text())
    for r in rows:
        r["tree"] = tree[0] if tree else None
    return rows


def worker(req_path: str, out_path: str) -> None:
    r = json.loads(Path(req_path).read_text())
    rows = []
    for batch, budget, t in r["jobs"]:
        rows.append(measure(r["models"][str(t)], batch, budget, t, r["rounds"]))
        print(json.dumps(rows[-1]), flush=True)
    Path(out_path).write_text(json.dumps(rows))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--budgets", default="0,8,32")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--sampled-vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--trees", default="", help="NAME=PATH,...: run each checkout of saguaro_vllm in turn")
    p.add_argument("--label", default="run")
    a = p.parse_args()
    a.batches = [int(x) for x in a.batches.split(",")]
    a.budgets = [int(x) for x in a.budgets.split(",")]
    a.temperatures = [float(x) for x in a.temperatures.split(",")]
    trees = [tuple(t.split("=", 1)) for t in a.trees.split(",") if t] or [None]
    trees = [(n, str(Path(path).resolve())) for n, path in trees] if trees != [None] else trees
    started = time.monotonic()
    load_start = os.getloadavg()
    rows = []
    from tqdm import tqdm

    for tree in tqdm(trees, desc="trees"):
        rows += run_tree(tree, a)
    from bench_transport import git_commit, machine  # this folder is on sys.path when run as a script

    info = {"name": "host-overhead", "kind": "host-overhead", "label": a.label,
            "date": datetime.datetime.now(datetime.UTC).isoformat(), "commit": git_commit(),
            "command": " ".join(sys.argv), "machine": machine(), "k": K,
            "model": "random Llama, 1 layer, hidden 16, float32, one thread", "results": rows,
            "runtime_s": round(time.monotonic() - started, 1),
            "load_avg": {"start": [round(x, 2) for x in load_start],
                         "end": [round(x, 2) for x in os.getloadavg()]}}
    for r in rows:
        print(json.dumps(r))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{info['date'][:10]}-host-overhead-{a.label}.json"
    out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
