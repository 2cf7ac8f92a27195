"""Times the saguaro CPU ops against their plain-torch references on this machine.

Cases are data (CASES below); results go to benchmarks/results/<date>-ops.json and a table on stdout.
Branch attention uses Llama-3.2-1B's attention shape (32 query heads, 8 kv heads, head size 64), K = 5,
24 branches per request, one layer. Usage:

    SAGUARO_OPS=compiled python benchmarks/bench_ops.py [--threads 2] [--quick]
    python benchmarks/bench_ops.py --round tiny            # a whole drafter round on CPU, ops vs references
    python benchmarks/bench_ops.py --round llama-3.2-1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("SAGUARO_OPS", "compiled")

from saguaro_vllm.drafter.sampling import sample_rows
from saguaro_vllm.ops import loader, reference

ATTN = dict(heads=32, kv_heads=8, head_size=64, K=5, branches=24, block_size=16)
ATTN_CASES = [  # (batch, prefix, dtype)
    (b, n, d) for d in ("float32", "bfloat16") for b in (1, 4, 16) for n in (256, 1024, 2048)
]
FORK_CASES = [  # (requests, prefix, dtype): 24 branches per request forked from it, one new token each
    (r, n, "bfloat16") for r in (1, 4) for n in (256, 1024, 2048)
]
SAMPLING_CASES = [  # (rows, vocab): candidate selection uses rows = batch, K+1 = 6 depths
    (24, 32000), (96, 128256),
]


def timeit(fn, min_time=0.5, max_reps=50) -> float:
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_args(batch, prefix, dtype):
    c = ATTN
    K, bs, nq = c["K"], c["block_size"], batch * c["branches"]
    per_req = -(-(prefix + K + 1) // bs)
    scratch = -(-(nq * K) // bs)
    nblocks = batch * per_req + scratch
    perm = torch.randperm(nblocks)
    tables = perm[: batch * per_req].view(batch, per_req).int()
    slots = (perm[batch * per_req :, None] * bs + torch.arange(bs)).flatten()[: nq * K].view(nq, K).long()
    dt_ = getattr(torch, dtype)
    return dict(
        query=torch.randn(nq, c["heads"], c["head_size"]).to(dt_),
        kv_cache=torch.randn(2, nblocks, bs, c["kv_heads"], c["head_size"]).to(dt_),
        block_tables=tables,
        prefix_lens=torch.full((batch,), prefix, dtype=torch.int32),
        owners=torch.arange(batch, dtype=torch.int32).repeat_interleave(c["branches"]),
        depths=torch.randint(0, K + 1, (nq,), dtype=torch.int32),
        steps=torch.full((nq,), K - 1, dtype=torch.int32),
        branch_slots=slots,
        scale=c["head_size"] ** -0.5,
    )


def fork_args(requests, prefix, dtype):
    """A pre-draft branch step as the drafter runs it: every branch is a sequence forked from its request
    (the request's full blocks, then a copy of its partial last block), with one new token (decode_attention:
    depth 0, step -1)."""
    c = ATTN
    bs, nb_req = c["block_size"], -(-prefix // c["block_size"])
    full = prefix // bs
    n = requests * c["branches"]
    nblocks = requests * nb_req + n * (nb_req - full + 1)
    perm = torch.randperm(nblocks).tolist()
    tables = []
    for _ in range(requests):
        own = [perm.pop() for _ in range(nb_req)]
        for _ in range(c["branches"]):
            tables.append(own[:full] + [perm.pop() for _ in range(nb_req - full + 1)])
    dt_ = getattr(torch, dtype)
    z = torch.zeros(n, dtype=torch.int32)
    return dict(
        query=torch.randn(n, c["heads"], c["head_size"]).to(dt_),
        kv_cache=torch.randn(2, nblocks, bs, c["kv_heads"], c["head_size"]).to(dt_),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        prefix_lens=torch.full((n,), prefix, dtype=torch.int32),
        owners=torch.arange(n, dtype=torch.int32), depths=z, steps=z - 1,
        branch_slots=torch.zeros(n, 1, dtype=torch.long), scale=c["head_size"] ** -0.5,
    )


# ---- a whole drafter round: glue forward, candidate selection, K multi-branch steps ---------------------
ROUND_SHAPES = {  # random Llama weights of these shapes (no checkpoint needed)
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                         num_heads=32, num_kv_heads=8, head_size=64),
    "tiny": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                 num_kv_heads=2, head_size=64),
}
ROUND = dict(batch=4, prefix=1024, K=5, fanout=[8, 5, 4, 3, 2, 2], block_size=16)  # 24 branches per request


def make_model(shape: str, dtype: torch.dtype, device: str):
    from saguaro_vllm.drafter.model.config import DraftModelConfig
    from saguaro_vllm.drafter.model.llama import LlamaForCausalLM

    cfg = DraftModelConfig(path="random", architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=5e5,
                           rope_scaling=None, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                           max_position_embeddings=131072, checkpoint_dtype=None, bos_token_id=None,
                           eos_token_id=None, **ROUND_SHAPES[shape])
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model.to(dtype).eval()


def drafter_round(model, caches, use_ops: bool, temperature: float, seed: int = 0) -> float:
    """Seconds for one round; the KV of the prefix is random (only its shape matters for timing)."""
    from saguaro_vllm.ops import BranchAttentionMetadata, candidates, proposal

    cfg, dev = model.config, caches[0].device
    B, N, K, bs = ROUND["batch"], ROUND["prefix"], ROUND["K"], ROUND["block_size"]
    fan = torch.tensor(ROUND["fanout"], dtype=torch.int32, device=dev).expand(B, K + 1)
    M = int(fan[0].sum())
    per_req = -(-(N + K + 1) // bs)
    g = torch.Generator(device="cpu").manual_seed(seed)
    tables = torch.arange(B * per_req, dtype=torch.int32).view(B, per_req).to(dev)
    scratch0 = B * per_req * bs
    branch_slots = (scratch0 + torch.arange(B * M * K)).view(B * M, K).to(dev)
    prefix_lens = torch.full((B,), N, dtype=torch.int32, device=dev)

    class Meta(BranchAttentionMetadata):
        @staticmethod
        def backend(q, k, v, kv_cache, meta, scale):
            if use_ops:
                return BranchAttentionMetadata.backend(q, k, v, kv_cache, meta, scale)
            reference.write_kv(k, v, kv_cache, meta.slot_mapping)
            return reference.branch_attention(q.to(kv_cache.dtype), kv_cache, meta.block_tables, meta.prefix_lens,
                                              meta.owners, meta.depths, meta.steps, meta.branch_slots, scale)

    def sample(logits):
        n, vocab = logits.shape
        args = (torch.full((n,), temperature, device=dev), torch.zeros(n, dtype=torch.int64, device=dev),
                torch.full((n,), 0.95, device=dev), torch.full((n,), 4, dtype=torch.int64, device=dev),
                torch.full((n,), 0.5, device=dev).log())
        if use_ops:
            q = proposal.proposal_probs(logits, *args[:4], saguaro_c=args[4].exp())
        else:
            q = reference.proposal_probs(logits, *args)
        return sample_rows(q, [None] * n)  # the drafter's draw: inverse CDF, one uniform per row

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        sync()
        t0 = time.perf_counter()
        # Glue forward over [b, x_1..x_K]: glue query j is (depth j, step -1).
        owners = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(K + 1)
        depths = torch.arange(K + 1, dtype=torch.int32, device=dev).repeat(B)
        pos = N + depths.long()
        glue_slots = tables.long()[owners.long(), pos // bs] * bs + pos % bs
        meta = Meta(glue_slots, tables, prefix_lens, owners, depths, torch.full_like(depths, -1),
                    torch.zeros(B * (K + 1), 1, dtype=torch.int64, device=dev))
        tokens = torch.randint(0, cfg.vocab_size, (B * (K + 1),), generator=g).to(dev)
        logits = model.compute_logits(model(tokens, pos, caches, meta))
        drafted = tokens.view(B, K + 1)[:, 1:]
        if use_ops:
            cand_tokens = candidates.select_candidates(logits.view(B, K + 1, -1), drafted, fan).tokens
        else:
            t_, _ = reference.select_candidates(logits.view(B, K + 1, -1), drafted, fan, int(fan.max()))
            cand_tokens = t_[t_ >= 0]
        owners = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(M)
        depths = torch.cat([torch.full((int(f),), j, dtype=torch.int32) for j, f in enumerate(ROUND["fanout"])])
        depths = depths.repeat(B).to(dev)
        tokens = cand_tokens
        for s in range(K):
            steps = torch.full_like(depths, s)
            meta = Meta.build(tables, prefix_lens, owners, depths, steps, branch_slots)
            pos = N + depths.long() + 1 + s
            tokens = sample(model.compute_logits(model(tokens, pos, caches, meta)))
        sync()
        return time.perf_counter() - t0


def run_round(shape: str, device: str, dtype_name: str, temperature: float, reps: int) -> list[dict]:
    dtype = getattr(torch, dtype_name)
    model = make_model(shape, dtype, device)
    cfg = model.config
    B, N, K, bs = ROUND["batch"], ROUND["prefix"], ROUND["K"], ROUND["block_size"]
    blocks = B * -(-(N + K + 1) // bs) + -(-(B * sum(ROUND["fanout"]) * K) // bs)
    caches = [torch.randn(2, blocks, bs, cfg.num_kv_heads, cfg.head_size, device=device).to(dtype)
              for _ in range(cfg.num_layers)]
    rows = []
    print(f"drafter round: {shape} {dtype_name} on {device}, {ROUND}, temperature {temperature}")
    for use_ops in (True, False):
        drafter_round(model, caches, use_ops, temperature)  # warm-up
        t = statistics.median(drafter_round(model, caches, use_ops, temperature, seed=i) for i in range(reps))
        rows.append(dict(op="drafter_round", shape=shape, device=device, dtype=dtype_name,
                         impl="ops" if use_ops else "reference", round_ms=t * 1e3, temperature=temperature,
                         **ROUND))
        print(f"  {'ops' if use_ops else 'reference':>9}: {t * 1e3:9.1f} ms per round")
    print(f"  speedup: {rows[1]['round_ms'] / rows[0]['round_ms']:.2f}x")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer cases (smoke run)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--round", choices=sorted(ROUND_SHAPES), help="time a whole drafter round instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    st = loader.status()
    assert loader.implementation(args.device) != "reference", st.error
    rows = []
    if args.round:
        rows = run_round(args.round, args.device, args.dtype, args.temperature, args.reps)
        return write(args, st, rows, "round")
    attn_cases = ATTN_CASES[::4] if args.quick else ATTN_CASES
    print(f"branch attention, one layer, {ATTN}, threads={args.threads}")
    print(f"{'batch':>5} {'prefix':>6} {'dtype':>8} {'op ms':>9} {'ref ms':>9} {'speedup':>8}")
    for batch, prefix, dtype in attn_cases:
        a = attention_args(batch, prefix, dtype)
        op = timeit(lambda a=a: torch.ops.saguaro.branch_attention(*a.values()))
        ref = timeit(lambda a=a: reference.branch_attention(**a), max_reps=10)
        rows.append(dict(op="branch_attention", batch=batch, prefix=prefix, dtype=dtype, op_ms=op * 1e3,
                         ref_ms=ref * 1e3, speedup=ref / op, **ATTN))
        print(f"{batch:>5} {prefix:>6} {dtype:>8} {op * 1e3:>9.2f} {ref * 1e3:>9.2f} {ref / op:>7.1f}x")
    print(f"\nforked branches, one new token each (the drafter's pre-draft step), {ATTN['branches']} per request")
    print(f"{'reqs':>5} {'prefix':>6} {'dtype':>8} {'op ms':>9} {'ref ms':>9} {'speedup':>8}")
    for requests, prefix, dtype in FORK_CASES[::3] if args.quick else FORK_CASES:
        a = fork_args(requests, prefix, dtype)
        op = timeit(lambda a=a: torch.ops.saguaro.branch_attention(*a.values()))
        ref = timeit(lambda a=a: reference.branch_attention(**a), max_reps=10)
        rows.append(dict(op="branch_attention_forked", batch=requests, prefix=prefix, dtype=dtype,
                         op_ms=op * 1e3, ref_ms=ref * 1e3, speedup=ref / op, **ATTN))
        print(f"{requests:>5} {prefix:>6} {dtype:>8} {op * 1e3:>9.2f} {ref * 1e3:>9.2f} {ref / op:>7.1f}x")
    print("\ncandidate selection (K+1 = 6, fan-out 4 per depth) and the proposal q' (T=0.8, top-p 0.95, F=4)")
    print(f"{'op':>18} {'rows':>5} {'vocab':>7} {'op ms':>9} {'ref ms':>9} {'speedup':>8}")
    for n, vocab in SAMPLING_CASES[:1] if args.quick else SAMPLING_CASES:
        b = max(1, n // 6)
        scores = torch.randn(b, 6, vocab)
        drafted = torch.randint(0, vocab, (b, 5))
        fanout = torch.full((b, 6), 4, dtype=torch.int32)
        op = timeit(lambda s=scores, d=drafted, f=fanout: torch.ops.saguaro.select_candidates(s, d, f, 4))
        ref = timeit(lambda s=scores, d=drafted, f=fanout: reference.select_candidates(s, d, f, 4), max_reps=5)
        rows.append(dict(op="select_candidates", rows=b * 6, vocab=vocab, op_ms=op * 1e3, ref_ms=ref * 1e3,
                         speedup=ref / op))
        print(f"{'select_candidates':>18} {b * 6:>5} {vocab:>7} {op * 1e3:>9.2f} {ref * 1e3:>9.2f} {ref / op:>7.1f}x")
        logits = torch.randn(n, vocab) * 3
        params = (torch.full((n,), 0.8), torch.zeros(n, dtype=torch.int64), torch.full((n,), 0.95),
                  torch.full((n,), 4, dtype=torch.int64), torch.full((n,), 0.5).log())
        op = timeit(lambda x=logits, p=params: torch.ops.saguaro.proposal_probs(x, *p))
        ref = timeit(lambda x=logits, p=params: reference.proposal_probs(x, *p), max_reps=5)
        rows.append(dict(op="proposal_probs", rows=n, vocab=vocab, op_ms=op * 1e3, ref_ms=ref * 1e3,
                         speedup=ref / op))
        print(f"{'proposal_probs':>18} {n:>5} {vocab:>7} {op * 1e3:>9.2f} {ref * 1e3:>9.2f} {ref / op:>7.1f}x")
    write(args, st, rows, "ops")


def save_results(out: Path, name: str, rows: list[dict], **meta) -> Path:
    """`out/<date>-<name>.json` with the rows and this machine's facts (shared by the ops benchmarks)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{dt.date.today().isoformat()}-{name}.json"
    meta = dict(date=dt.datetime.now().isoformat(timespec="seconds"), machine=platform.machine(),
                processor=platform.processor(), cpus=os.cpu_count(), torch=torch.__version__,
                cpu_capability=torch.backends.cpu.get_cpu_capability(), load_avg=os.getloadavg(), **meta)
    path.write_text(json.dumps(dict(meta=meta, results=rows), indent=1) + "\n")
    print(f"\nwrote {path}")
    return path


def write(args, st, rows, kind: str) -> None:
    save_results(args.out, f"{kind}{'-' + args.tag if args.tag else ''}", rows, threads=args.threads,
                 library=st.library, cpu_isa=torch.ops.saguaro.cpu_isa() if st.loaded else None)

if __name__ == "__main__":
    main()
