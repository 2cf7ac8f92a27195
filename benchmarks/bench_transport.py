"""What the sampled (T > 0) path costs per step at real vocabulary sizes: Saguaro `sync` against vLLM's own
in-process `draft_model`, each with draft == target (so acceptance is the same at T = 0 and T = 1).

The model is a random-weight Llama of tiny depth (1 layer, hidden 64) with a big vocabulary, so compute is
small and moving and assembling proposal probabilities (`[rows, K, vocab]` float32) dominates what T = 1
adds. One engine per (engine, vocabulary), in a fresh process (front end, engine core and worker in one
process); inside it, timers wrap the proposer's `propose`, the drafter round trip and vLLM's rejection
sampler, and each (batch, temperature) job reports per-step means:

- `step_ms`: generate wall time / engine steps (one `propose` call per step);
- `propose_ms`: the proposer's `propose` (Saguaro: message, drafter round trip, probability assembly and
  copy to the target's device; `draft_model`: its draft forwards and sampling);
- Saguaro only: `drafter_ms` (the drafter's own compute, `StepResponse.compute_s`, incl. making q),
  `ours_ms` = `propose_ms - drafter_ms` (wall clock: transport, proposer-side work and, on a busy machine,
  waits for a core), and `propose_cpu_ms`: the CPU time of the proposer's thread in `propose` (message,
  receive, checks, probability assembly; no waiting): the part the 3 ms bar of issue 16 is about;
- `gather_ms`: vLLM's `_get_spec_decode_draft_probs` (concatenates the rows of the proposer's probability
  tensor for the sampler), `rejection_ms`: vLLM's rejection sampler; both paid by every method.

    .venv/bin/python benchmarks/bench_transport.py --label before          # full matrix (~15 min)
    .venv/bin/python benchmarks/bench_transport.py --vocabs 128256 --batches 16 --label smoke
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = Path(os.environ.get("SAGUARO_CACHE", Path.home() / ".cache" / "saguaro-vllm")) / "bench-transport"
ENGINES = ("vllm-ar", "vllm-draft_model", "saguaro-sync", "saguaro-async")
PROMPT_LEN = 16


def build_model(vocab: int) -> Path:
    """A 1-layer, hidden-64 random Llama with `vocab` tokens (cached; no tokenizer: prompts are token ids)."""
    path = CACHE / f"llama-h64-l1-v{vocab}"
    if (path / "model.safetensors").exists():
        return path
    sys.path.insert(0, str(ROOT / "tests"))
    from distribution import build_tiny_llama

    return build_tiny_llama(path, vocab_size=vocab, num_layers=1, hidden_size=64, num_heads=2)


def spec_config(engine: str, model: Path, k: int) -> dict | None:
    if engine == "vllm-ar":
        return None  # plain autoregressive decoding: the floor every speculative path is measured against
    if engine == "vllm-draft_model":
        # probabilistic: vLLM's draft model samples and hands its q to the rejection sampler (the default,
        # greedy, drafts the argmax and verifies it one-hot: no probabilities to move at all).
        return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic"}
    if engine in ("saguaro-sync", "saguaro-async"):
        # float32 like the target, so draft == target holds numerically too (acceptance ~1 at T = 1).
        return {"method": "saguaro", "model": str(model), "num_speculative_tokens": k,
                "saguaro": {"mode": engine.removeprefix("saguaro-"), "dtype": "float32", "step_timeout_s": 120}}
    raise ValueError(f"--engines: unknown engine {engine!r}; choose from {', '.join(ENGINES)}")


def run_engine(engine: str, vocab: int, args: argparse.Namespace, tree: tuple[str, str] | None = None) -> list[dict]:
    """One engine in a fresh process; `tree` (name, path): run that checkout of saguaro_vllm (e.g. the code
    before a change) by putting it first on the path of the engine and of the drafter it starts."""
    model = build_model(vocab)
    request = {"engine": engine, "vocab": vocab, "model": str(model), "spec": spec_config(engine, model, args.k),
               "batches": args.batches, "temperatures": args.temperatures, "max_tokens": args.max_tokens,
               "max_num_seqs": args.max_num_seqs or max(args.batches)}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    cwd = None
    if tree is not None:  # `python -m` (the drafter) puts its cwd first on sys.path: run inside the tree
        env["PYTHONPATH"] = os.pathsep.join([tree[1], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cwd = tree[1]
    with tempfile.TemporaryDirectory(prefix="saguaro-bench-transport-") as tmp:
        req, out, log = Path(tmp, "req.json"), Path(tmp, "out.json"), Path(tmp, "log")
        req.write_text(json.dumps(request))
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(req), str(out)],
                                  env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout_s,
                                  check=False)
        if os.environ.get("SAGUARO_BENCH_LOG_DIR"):
            name = f"{engine}-{tree[0]}-{vocab}" if tree else f"{engine}-{vocab}"
            Path(os.environ["SAGUARO_BENCH_LOG_DIR"], f"{name}.log").write_text(log.read_text())
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{engine} at vocab {vocab} failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
        results = json.loads(out.read_text())
    for r in results:
        r["tree"] = tree[0] if tree else None
    return results


# -------------------------------------------------------------------------------- inside the engine

class Timers:
    """Per-job sums of wrapped calls (the engine runs in this process, so class attributes can be wrapped)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.ssd: dict[str, list[float]] = {}  # mode async: the drafter's per-step round figures
        self.sums: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, owner, attr: str, name: str, on_result=None, cpu: bool = False) -> None:
        """Time `owner.attr` (wall clock; with `cpu`, also this thread's CPU time as `<name>_cpu`, which
        waiting for another process or for a core on a shared machine does not inflate)."""
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*a, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            out = original(*a, **kw)
            self.add(name, time.perf_counter() - t0)
            if cpu:
                self.add(f"{name}_cpu", time.thread_time() - c0)
            if on_result is not None:
                on_result(out)
            return out

        setattr(owner, attr, timed)


def worker(req_path: str, out_path: str) -> None:
    r = json.loads(Path(req_path).read_text())
    if not r["engine"].startswith("saguaro"):
        os.sched_setaffinity(0, [0])  # the core Saguaro's placement gives its target; the drafter gets the other
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    timers = Timers()
    proposers: list = []  # Saguaro: the proposer instance (its proposal ring)
    timers.wrap(RejectionSampler, "forward", "rejection")
    timers.wrap(GPUModelRunner, "_get_spec_decode_draft_probs", "gather")
    if r["engine"].startswith("saguaro"):
        from saguaro_vllm.worker.drafter_client import DrafterClient
        from saguaro_vllm.worker.proposer import SaguaroProposer

        timers.wrap(SaguaroProposer, "propose", "propose", cpu=True)
        original_init = SaguaroProposer.__init__

        def init(self, *a, **kw):
            original_init(self, *a, **kw)
            proposers.append(self)

        SaguaroProposer.__init__ = init
        def on_reply(resp):
            timers.add("drafter", resp.compute_s)
            for key in ("verify_s", "late_s", "predraft_s", "budget", "plan_steps", "topups"):
                if resp.ssd and key in resp.ssd:
                    timers.ssd.setdefault(key, []).append(float(resp.ssd[key]))

        timers.wrap(DrafterClient, "step", "roundtrip", on_result=on_reply)
    elif r["engine"] == "vllm-draft_model":
        from vllm.v1.spec_decode.draft_model import DraftModelProposer

        timers.wrap(DraftModelProposer, "propose", "propose")
    else:  # AR: one step per `execute_model`
        timers.wrap(GPUModelRunner, "execute_model", "propose")

    llm = LLM(model=r["model"], speculative_config=r["spec"], dtype="float32", enforce_eager=True,
              max_model_len=128, max_num_seqs=r["max_num_seqs"], max_num_batched_tokens=4096,
              skip_tokenizer_init=True, disable_log_stats=False, distributed_executor_backend="uni", seed=0,
              enable_prefix_caching=False)
    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(2, r["vocab"] - 2, PROMPT_LEN).tolist()} for _ in range(n)]

    def counters() -> dict[str, float]:
        out = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()
               if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
        if r["engine"].startswith("saguaro"):
            from saguaro_vllm.worker.metrics import saguaro_samples

            out.update({k: v for k, v in saguaro_samples().items() if k.split("{")[0].endswith("_total")})
        return out

    for t in r["temperatures"]:  # warm-up: every code path once (first calls allocate and compile)
        llm.generate(prompts(2), SamplingParams(temperature=t, max_tokens=12, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
    results = []
    for batch in r["batches"]:
        for t in r["temperatures"]:
            sp = SamplingParams(temperature=t, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
            batch_prompts = prompts(batch)
            before = counters()
            load = os.getloadavg()[0]
            timers.reset()
            t0 = time.perf_counter()
            llm.generate(batch_prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
            after = counters()
            d = {k.removeprefix("vllm:spec_decode_num_"): after[k] - before.get(k, 0) for k in after}
            saguaro = {k.removeprefix("vllm:saguaro_"): v for k, v in d.items() if k.startswith("vllm:saguaro_") and v}
            rounds = {f"mean_{k}": sum(v) / len(v) for k, v in timers.ssd.items() if v}
            ring = next((p.ring for p in proposers if getattr(p, "ring", None) is not None), None)
            if ring is not None:  # reserved: the sparse file's size; used: its pages written so far
                rounds["ring_reserved_mb"] = ring.nbytes / 2**20
                rounds["ring_used_mb"] = ring.resident_bytes() / 2**20
            steps = timers.calls.get("propose", 0)
            per_step = {f"{k}_ms": 1000 * v / steps for k, v in timers.sums.items()} if steps else {}
            if "drafter_ms" in per_step:
                per_step["ours_ms"] = per_step["propose_ms"] - per_step["drafter_ms"]
            results.append({
                "engine": r["engine"], "vocab": r["vocab"], "batch": batch, "temperature": t, "k": (r["spec"] or {}).get(
                    "num_speculative_tokens"), "steps": steps, "wall_s": wall,
                "step_ms": 1000 * wall / steps if steps else None, **per_step,
                "acceptance_rate": d["accepted_tokens"] / d["draft_tokens"] if d.get("draft_tokens") else None,
                "drafts": d.get("drafts"), "draft_tokens": d.get("draft_tokens"),
                "accepted_tokens": d.get("accepted_tokens"), "saguaro": saguaro, "rounds": rounds,
                "ring_used_mb": rounds.get("ring_used_mb"), "ring_reserved_mb": rounds.get("ring_reserved_mb"),
                "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],  # at the job's start and end
            })
            print(json.dumps(results[-1]), flush=True)
    Path(out_path).write_text(json.dumps(results))


# ------------------------------------------------------------------------- micro: our part alone

def micro(vocab: int, batch: int, k: int, repeats: int) -> list[dict]:
    """Our part without engines, per step with every row sampled: the drafter's q and tokens (logits ->
    q -> token) and what happens between the processes up to the rejection sampler's tensor, before (pickled
    `[K, vocab]` arrays and the loop-built dense tensor, as on b37cf6e) and after (q written into a ring slot,
    the proposer's checks and zero-copy assembly). CPU time of this thread, one thread, min over repeats."""
    import pickle

    import numpy as np
    import torch

    from saguaro_vllm.drafter.sampling import sample_proposals
    from saguaro_vllm.shared.proposal_buffers import ProposalRing, SlotWriter, assemble, draft_positions
    from saguaro_vllm.shared.transport import SamplingSpec

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, vocab, generator=gen) * 3 for _ in range(k)]
    spec = SamplingSpec(temperature=1.0)
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    ring = ProposalRing.create(rows=batch, k=k, vocab=vocab)

    def before_drafter():  # b37cf6e: a softmax and an exponential race per row
        probs = {j: [] for j in range(batch)}
        drafts = [[] for _ in range(batch)]
        for pos in range(k):
            for j in range(batch):
                q = (logits[pos][j] / spec.temperature).softmax(-1)
                e = torch.empty_like(q).exponential_(1.0, generator=gens[j])
                drafts[j].append(int((q / e).argmax()))
                probs[j].append(q.cpu().numpy())
        return drafts, pickle.dumps({j: np.stack(p) for j, p in probs.items()}, protocol=pickle.HIGHEST_PROTOCOL)

    def before_proposer(drafts, payload):
        probs = pickle.loads(payload)
        dense = torch.zeros(batch, k, vocab, dtype=torch.float32)
        for i, toks in enumerate(drafts):
            for pos, tok in enumerate(toks):
                dense[i, pos, tok] = 1.0
        for j, q in probs.items():
            dense[j, : len(drafts[j])] = torch.from_numpy(q[: len(drafts[j]), :vocab])
        return dense

    def after_drafter():  # the drafter's sampler (one batched q' per position), q' copied into a ring slot
        w = SlotWriter(ring, seq=1)
        assert w.available, "no free ring slot"
        buf = w.buffer()
        for j in range(batch):
            w.row_of(j)
        toks = []
        for pos in range(k):
            tok, q = sample_proposals(logits[pos], [spec] * batch, gens)
            buf[:batch, pos].copy_(q)
            toks.append(tok)
        slot, rows = w.finish()
        return torch.stack(toks, 1).tolist(), slot, rows

    def after_proposer(drafts, slot, rows):
        assert ring.held(slot, 1)
        buf = ring.slot(slot)
        assert bool((buf[draft_positions([drafts[j] for j in rows])] > 0).all())
        probs, _ = assemble(buf, rows, drafts, k)
        ring.release_held()
        return probs

    def cpu_ms(fn, *a):
        best, out = float("inf"), None
        for _ in range(repeats):
            c0 = time.thread_time()
            out = fn(*a)
            best = min(best, time.thread_time() - c0)
        return 1000 * best, out

    res = []
    d_ms, (drafts, payload) = cpu_ms(before_drafter)
    p_ms, _ = cpu_ms(before_proposer, drafts, payload)
    res.append({"path": "before", "vocab": vocab, "batch": batch, "k": k, "drafter_cpu_ms": d_ms,
                "proposer_cpu_ms": p_ms, "payload_mb": len(payload) / 2**20})
    d_ms, _ = cpu_ms(lambda: (after_drafter(), ring.release_held())[0])  # each repeat frees its slot again
    drafts, slot, rows = after_drafter()
    p_ms, _ = cpu_ms(lambda: (ring.header.__setitem__((slot, 0), 2), after_proposer(drafts, slot, rows))[1])
    res.append({"path": "after", "vocab": vocab, "batch": batch, "k": k, "drafter_cpu_ms": d_ms,
                "proposer_cpu_ms": p_ms, "payload_mb": 0.0})
    ring.close()
    return res


# ------------------------------------------------------------------------------------------ driver

def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m_at_start": load}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="128256,151936")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=0, help="the engines' max_num_seqs (default: the largest "
                   "batch); e.g. 1024, vLLM's default on large GPUs, to measure the proposal ring's memory")
    p.add_argument("--max-tokens", type=int, default=36, help="output tokens per request (6 steps at K=5)")
    p.add_argument("--label", default="run", help="results file: <date>-transport-<label>.json")
    p.add_argument("--note", default="", help="free text stored with the results (e.g. machine contention)")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--micro", action="store_true", help="our part alone, without engines (see `micro`)")
    p.add_argument("--repeats", type=int, default=3, help="--micro: repeats per case (the minimum is kept)")
    p.add_argument("--trees", default="", help="NAME=PATH,...: run the Saguaro engines once per checkout of "
                   "saguaro_vllm (e.g. before=/tmp/old,after=.), interleaved per vocabulary")
    a = p.parse_args(argv)
    a.vocabs = [int(v) for v in a.vocabs.split(",")]
    a.batches = [int(b) for b in a.batches.split(",")]
    a.temperatures = [float(t) for t in a.temperatures.split(",")]
    a.engines = a.engines.split(",")
    a.trees = [tuple(t.split("=", 1)) for t in a.trees.split(",") if t]
    for name, path in a.trees:
        if not Path(path, "saguaro_vllm", "__init__.py").exists():
            raise SystemExit(f"--trees: {name}={path} holds no saguaro_vllm package")
    a.trees = [(name, str(Path(path).resolve())) for name, path in a.trees]
    for engine in a.engines:
        spec_config(engine, Path("."), a.k)  # unknown names fail before any engine starts
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.micro:
        rows = [r for v in args.vocabs for b in args.batches for r in micro(v, b, args.k, args.repeats)]
        info = {"name": "transport-micro", "kind": "transport-micro", "label": args.label,
                "date": datetime.datetime.now(datetime.UTC).isoformat(), "commit": git_commit(),
                "command": " ".join(sys.argv), "machine": machine(), "note": args.note, "results": rows}
        for r in rows:
            print(json.dumps(r))
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = RESULTS / f"{info['date'][:10]}-transport-micro-{args.label}.json"
        out.write_text(json.dumps(info, indent=1) + "\n")
        print(f"wrote {out}")
        return 0
    info = {"name": "transport", "kind": "transport", "label": args.label, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "commit": git_commit(), "command": " ".join(sys.argv), "machine": machine(), "note": args.note,
            "model": "random Llama, 1 layer, hidden 64, float32; draft == target", "k": args.k,
            "max_tokens": args.max_tokens, "prompt_len": PROMPT_LEN, "max_num_seqs": args.max_num_seqs or max(args.batches),
            "placement": "vLLM draft_model: whole engine on core 0; Saguaro: target on core 0, drafter on core 1",
            "results": []}
    for vocab in args.vocabs:
        for engine in args.engines:
            for tree in (args.trees or [None]) if engine.startswith("saguaro") else [None]:
                print(f"== {engine} {tree[0] if tree else ''} vocab {vocab}", flush=True)
                info["results"] += run_engine(engine, vocab, args, tree)
    info["runtime_s"] = round(time.monotonic() - started, 1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{info['date'][:10]}-transport-{args.label}.json"
    out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {out} ({info['runtime_s']} s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
