"""Cost regimes: is `mode: async` (SSD) never slower than `sync`, and where does it win?

A matrix over the draft/target cost ratio, the vocabulary, the batch and the temperature. Each (ratio,
vocabulary) is a pair from `tests/distribution.build_embedded_pair`: a draft (hidden 32, 2 layers) and a
target of hidden `width` that computes exactly the same function (the draft's weights embedded in its first
dimensions, the rest zero), so acceptance is ~1 at every temperature while the target costs what a model
of its width costs. `width` is the smallest multiple of 32 whose compute (multiply-adds per token) puts the
draft at or below the asked ratio; ratio 1 is the draft itself as the target.

Per (ratio, vocabulary) each engine (`sync`, `async`, vLLM `draft_model` with probabilistic drafts) runs
in a fresh process (target on core 0, Saguaro's drafter on core 1; `draft_model` in the target's process),
the engines interleaved, `--repeats` times; inside each process every (batch, T) cell generates once.
Each cell first runs once unmeasured (16 tokens: SSD's pre-draft switch meets the cell's batch and
temperature there), then `generate` calls of `--max-tokens` per request until `--cell-s` seconds are
measured (a single 48-token call lasts 0.1-0.5 s at batch 1: one scheduler hiccup would decide it).
Each cell reports tokens/s as a user sees them (generated tokens over the `generate` calls' wall time),
and for `async` the cache hit rate and the share of steps that followed a pre-draft (the rest were
drafted as `sync` does: `vllm:saguaro_rounds{mode}`); for Saguaro's engines, where a step's time goes: the
wall time per engine step, the worker's wait for the drafter's answer in it, and the drafter's compute.

    .venv/bin/python benchmarks/regimes.py                                   # the whole matrix
    .venv/bin/python benchmarks/regimes.py --ratios 1 --vocabs 128256 --batches 16 --temperatures 0
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path(os.environ.get("SAGUARO_CACHE", Path.home() / ".cache" / "saguaro-vllm")) / "regimes"
ENGINES = ("sync", "async", "draft_model")
#: Saguaro samples a cell's counters take: totals, and the sums and counts of the drafter's step and compute
#: times (per-step figures).
PER_STEP = ("_total", "drafter_step_seconds_sum", "drafter_step_seconds_count", "drafter_compute_seconds_sum",
            "late_seconds_sum")
DRAFT_HIDDEN = 32
LAYERS = 2
PROMPT_LEN = 12
#: The goals of the matrix: SSD at least this share of `sync` in every cell (median over repeats) ...
FLOOR = 0.97
#: ... and at least this share where the draft is cheap (ratio <= 0.2), the batch <= 16 and T = 0.
WIN = 1.15


def macs_per_token(hidden: int, vocab: int) -> int:
    """Multiply-adds per token of a `LAYERS`-layer Llama of `hidden` (MLP 2 x hidden) and its LM head."""
    return vocab * hidden + LAYERS * (4 * hidden * hidden + 3 * hidden * 2 * hidden)


def width_for(ratio: float, vocab: int) -> int:
    """The target's hidden size: the smallest multiple of DRAFT_HIDDEN at which the draft's compute per token
    is at most `ratio` of the target's (ratio >= 1: the draft itself)."""
    draft = macs_per_token(DRAFT_HIDDEN, vocab)
    width = DRAFT_HIDDEN
    while draft > ratio * macs_per_token(width, vocab):
        width += DRAFT_HIDDEN
    return width


def build_pair(ratio: float, vocab: int) -> tuple[Path, Path, int]:
    """(target, draft, width) for a cell, built once and cached."""
    width = width_for(ratio, vocab)
    root = CACHE / f"v{vocab}"
    target = root / ("draft" if width == DRAFT_HIDDEN else f"target-w{width}")
    draft = root / "draft"
    if not ((target / "model.safetensors").exists() and (draft / "model.safetensors").exists()):
        sys.path.insert(0, str(ROOT / "tests"))
        from distribution import build_embedded_pair

        target, draft = build_embedded_pair(root, vocab_size=vocab, width=width, draft_hidden=DRAFT_HIDDEN,
                                            num_layers=LAYERS)
    return target, draft, width


def spec_config(engine: str, draft: Path, k: int) -> dict:
    if engine == "draft_model":
        return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic"}  # the greedy default accepts little at T > 0
    return {"method": "saguaro", "model": str(draft), "num_speculative_tokens": k,
            "saguaro": {"mode": engine, "dtype": "float32", "step_timeout_s": 120}}


def run_engine(engine: str, target: Path, draft: Path, args: argparse.Namespace) -> list[dict]:
    """One engine in a fresh process over every (batch, T) cell."""
    request = {"engine": engine, "target": str(target), "spec": spec_config(engine, draft, args.k),
               "batches": args.batches, "temperatures": args.temperatures, "max_tokens": args.max_tokens,
               "max_num_seqs": max(args.batches), "cell_s": args.cell_s}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with tempfile.TemporaryDirectory(prefix="saguaro-regimes-") as tmp:
        req, out, log = Path(tmp, "req.json"), Path(tmp, "out.json"), Path(tmp, "log")
        req.write_text(json.dumps(request))
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(req), str(out)],
                                  env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s, check=False)
        if args.logs:  # each engine process's log (the drafter's lines too: why SSD pre-drafted or not)
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            Path(args.logs, f"{target.parent.name}-{target.name}-{engine}-{time.strftime('%H%M%S')}.log").write_text(
                log.read_text())
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{engine} on {target.name} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
        return json.loads(out.read_text())


def worker(req_path: str, out_path: str) -> None:
    """Inside the engine's process: every cell once, with the counters each cell moved."""
    r = json.loads(Path(req_path).read_text())
    if r["engine"] == "draft_model":
        os.sched_setaffinity(0, [0])  # the core Saguaro's placement gives its target
    import numpy as np
    from vllm import LLM, SamplingParams

    llm = LLM(model=r["target"], speculative_config=r["spec"], dtype="float32", enforce_eager=True,
              max_model_len=256, max_num_seqs=r["max_num_seqs"], max_num_batched_tokens=4096,
              skip_tokenizer_init=True, disable_log_stats=False, distributed_executor_backend="uni", seed=0,
              enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = np.random.default_rng(0)

    def counters() -> dict[str, float]:
        out = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
        if r["engine"] != "draft_model":
            from saguaro_vllm.worker.metrics import saguaro_samples

            out.update({k: v for k, v in saguaro_samples().items() if k.split("{")[0].endswith(PER_STEP)})
        return out

    def generate(batch: int, t: float, max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.integers(2, vocab - 2, PROMPT_LEN).tolist()} for _ in range(batch)]
        sp = SamplingParams(temperature=t, max_tokens=max_tokens, ignore_eos=True, detokenize=False, seed=None)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    for t in r["temperatures"]:  # warm-up: every path once
        generate(2, t, 12)
    results = []
    for batch in r["batches"]:
        for t in r["temperatures"]:
            generate(batch, t, 16)  # the cell's shape once, unmeasured (SSD's switch meets it here first)
            before = counters()
            wall, calls = 0.0, 0
            while calls == 0 or wall < r["cell_s"]:  # whole `generate` calls until the cell's time is reached
                wall += generate(batch, t, r["max_tokens"])
                calls += 1
            d = {k: v - before.get(k, 0) for k, v in counters().items()}
            lookups = sum(v for k, v in d.items() if k.startswith("vllm:saguaro_cache_lookups"))
            hits = sum(v for k, v in d.items() if k.startswith("vllm:saguaro_cache_hits"))
            pre = d.get('vllm:saguaro_rounds_total{mode="predraft"}', 0)
            sync = d.get('vllm:saguaro_rounds_total{mode="sync"}', 0)
            drafted = d.get("vllm:spec_decode_num_draft_tokens", 0)
            steps = d.get("vllm:saguaro_drafter_step_seconds_count", 0)
            results.append({
                "engine": r["engine"], "batch": batch, "temperature": t, "wall_s": wall, "calls": calls,
                "tokens_per_s": calls * batch * r["max_tokens"] / wall,
                "acceptance": d.get("vllm:spec_decode_num_accepted_tokens", 0) / drafted if drafted else None,
                "hit_rate": hits / lookups if lookups else None,
                "predraft_share": pre / (pre + sync) if pre + sync else None,
                # where a step's time goes (Saguaro's engines): the engine step, the worker's wait for the
                # drafter's answer, the drafter's compute inside it
                "step_ms": 1e3 * wall / steps if steps else None,
                "round_trip_ms": 1e3 * d.get("vllm:saguaro_drafter_step_seconds_sum", 0) / steps if steps else None,
                "compute_ms": 1e3 * d.get("vllm:saguaro_drafter_compute_seconds_sum", 0) / steps if steps else None,
                "late_ms": 1e3 * d.get("vllm:saguaro_late_seconds_sum", 0) / steps if steps else None,
            })
            print(json.dumps(results[-1]), flush=True)
    Path(out_path).write_text(json.dumps(results))


def summarize(runs: list[dict], args: argparse.Namespace, pairs: dict) -> dict:
    """Per cell and engine: tokens/s of every repeat, and (SSD) the hit rate and pre-draft share."""
    cells = []
    for (ratio, vocab), (width, compute_ratio) in pairs.items():
        for batch in args.batches:
            for t in args.temperatures:
                engines = {}
                for engine in args.engines:
                    mine = [x for x in runs if (x["ratio"], x["vocab"], x["engine"], x["batch"], x["temperature"])
                            == (ratio, vocab, engine, batch, t)]
                    if not mine:
                        continue
                    e = {"tokens_per_s": [round(x["tokens_per_s"], 2) for x in mine],
                         "acceptance": _mean([x["acceptance"] for x in mine])}
                    if engine == "async":
                        e.update(hit_rate=_mean([x["hit_rate"] for x in mine]),
                                 predraft_share=_mean([x["predraft_share"] for x in mine]))
                    for key in ("step_ms", "round_trip_ms", "compute_ms", "late_ms"):
                        if any(x.get(key) is not None for x in mine):
                            e[key] = _mean([x.get(key) for x in mine])
                    engines[engine] = e
                cell = {"ratio": ratio, "vocab": vocab, "batch": batch, "temperature": t, "width": width,
                        "compute_ratio": round(compute_ratio, 4), "engines": engines}
                if "sync" in engines and "async" in engines:
                    s = statistics.median(engines["sync"]["tokens_per_s"])
                    a = statistics.median(engines["async"]["tokens_per_s"])
                    cell["async_over_sync"] = round(a / s, 3)
                    goal = WIN if ratio <= 0.2 and batch <= 16 and t == 0 else FLOOR
                    cell["goal"], cell["met"] = goal, a / s >= goal
                cells.append(cell)
    return {"cells": cells, "goals": {"floor": FLOOR, "win": WIN, "win_where": "ratio <= 0.2, batch <= 16, T = 0",
                                      "met": sum(c.get("met", False) for c in cells),
                                      "cells": sum("met" in c for c in cells)}}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 4) if values else None


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratios", default="0.05,0.2,1", help="draft/target compute ratios")
    p.add_argument("--vocabs", default="32000,128256")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--repeats", type=int, default=2, help="processes per engine and pair, interleaved")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request of each `generate` call")
    p.add_argument("--cell-s", type=float, default=3.0,
                   help="seconds each cell measures at least (whole `generate` calls; 0: one call)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--label", default="matrix", help="results file: <date>-regimes-<label>.json")
    p.add_argument("--logs", help="keep each engine process's log in this directory")
    p.add_argument("--note", default="", help="free text stored with the results and shown on the page")
    args = p.parse_args(argv)
    args.ratios = [float(x) for x in args.ratios.split(",")]
    args.vocabs = [int(x) for x in args.vocabs.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.temperatures = [float(x) for x in args.temperatures.split(",")]
    args.engines = [x for x in args.engines.split(",") if x]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"--engines: unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    args = parse_args(argv)
    from tqdm import tqdm

    pairs, runs = {}, []
    for ratio in args.ratios:
        for vocab in args.vocabs:
            target, draft, width = build_pair(ratio, vocab)
            pairs[(ratio, vocab)] = (width, macs_per_token(DRAFT_HIDDEN, vocab) / macs_per_token(width, vocab))
    jobs = [(rep, key, engine) for rep in range(args.repeats) for key in pairs for engine in args.engines]
    t0 = time.time()
    for rep, (ratio, vocab), engine in tqdm(jobs, desc="regimes", unit="engine"):
        target, draft, _ = build_pair(ratio, vocab)
        for x in run_engine(engine, target, draft, args):
            runs.append({**x, "ratio": ratio, "vocab": vocab, "repeat": rep})
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from run import run_date

    out = {"name": f"regimes-{args.label}", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": machine(), "seconds": round(time.time() - t0, 1),
           "settings": {"k": args.k, "max_tokens": args.max_tokens, "cell_s": args.cell_s, "prompt_len": PROMPT_LEN,
                        "repeats": args.repeats, "draft": f"hidden {DRAFT_HIDDEN}, {LAYERS} layers",
                        "placement": "target core 0, Saguaro's drafter core 1; draft_model in the target's process"},
           **({"note": args.note} if args.note else {}), **summarize(runs, args, pairs), "runs": runs}
    path = RESULTS / f"{run_date()}-regimes-{args.label}.json"
    path.write_text(json.dumps(out, indent=1))
    for c in out["cells"]:
        print(f"ratio {c['ratio']:<5} vocab {c['vocab']:<6} batch {c['batch']:<3} T {c['temperature']:<3} "
              f"async/sync {c.get('async_over_sync', '-')}  (goal {c.get('goal', '-')})  "
              + "  ".join(f"{e}: {statistics.median(v['tokens_per_s']):.1f}" for e, v in c["engines"].items()))
    print(f"wrote {path} ({out['seconds']} s); goals met in {out['goals']['met']} of {out['goals']['cells']} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
