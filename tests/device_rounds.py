"""`SSDDrafter` rounds on a random-weight draft, in-process, with torch alone (no vLLM, pyzmq or msgspec).

A test helper, not a test: used by `tests/test_drafter_standalone.py`, by benchmarks/device_check.py (the GPU
check) and by benchmarks/bench_host_overhead.py. Each configuration (batch,
fan-out budget, CUDA graphs on/off) prefills random prompts, then runs rounds: the pre-draft (glue forward,
then branch steps) and an answer whose rows all hit the speculation cache (even rounds) or all miss and are
drafted just in time (odd rounds). With `cuda_graphs`, one-token forwards take the static decode path and
its CUDA graphs (static_forward.py; on CPU the same path without capture); `graph_mode` says what ran.
Times are taken with a device sync before each clock read, the first round is a warm-up (Triton compiles,
graph captures), and a last round counts device-to-host transfers (`.item/.tolist/int/bool/.cpu` on
tensors of the draft's device) per forward.
"""
from __future__ import annotations

import collections
import statistics
import sys
import time
from pathlib import Path

import torch

K = 5
SHAPES = {  # random Llama weights of these shapes (no checkpoint)
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                         num_heads=32, num_kv_heads=8, head_size=64, tie_word_embeddings=True),
    "smoke": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_size=64, tie_word_embeddings=False),
}


def make_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0):
    """A `LlamaForCausalLM` of `SHAPES[shape]` with random weights, built directly on `device`."""
    from saguaro_vllm.drafter.model.config import DraftModelConfig
    from saguaro_vllm.drafter.model.llama import LlamaForCausalLM

    cfg = DraftModelConfig(path=f"random:{shape}", architecture="LlamaForCausalLM", rms_norm_eps=1e-5,
                           rope_theta=5e5, rope_scaling=None, attention_bias=False, mlp_bias=False,
                           max_position_embeddings=131072, checkpoint_dtype=None, bos_token_id=None,
                           eos_token_id=None, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model.to(dtype).eval().requires_grad_(False)


def make_runner(model, num_blocks: int, cuda_graphs: bool):
    """A runner, and the seconds its graph capture took: with `cuda_graphs`, every bucket captured up front
    on CUDA (as the drafter does at start-up, so no round pays a capture), and on CPU the same static decode
    path without capture (`static_buckets`: graphs exist on CUDA only)."""
    from saguaro_vllm.drafter.kv_cache import KVCacheConfig
    from saguaro_vllm.drafter.runner import DraftModelRunner
    from saguaro_vllm.drafter.static_forward import BUCKETS

    kwargs = {}
    if cuda_graphs:
        on_cuda = next(model.parameters()).device.type == "cuda"
        kwargs = {"cuda_graphs": True} if on_cuda else {"static_buckets": BUCKETS}
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=16), **kwargs)
    return runner, runner.capture_graphs()


def _transfer_counter(device_type: str):
    """tests/sync_count.py's counter, restricted to tensors on `device_type` (on CUDA only those sync)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sync_count import CountTransfers

    class DeviceTransfers(CountTransfers):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.device.type != device_type:
                return func(*args, **(kwargs or {}))
            return super().__torch_function__(func, types, args, kwargs)

    return DeviceTransfers()


def _ms(values: list[float]) -> float | None:
    return round(1e3 * statistics.median(values), 3) if values else None


def count_forwards(runner) -> list[int]:
    """Counts the runner's forwards in the returned one-element list: `forward` and `forward_batch` (branch
    steps; runners of trees before it have none), once when the latter runs the former for rows without room."""
    forwards, inside = [0], [0]

    def counting(fn):
        def counted(*a, **kw):
            if inside[0]:
                return fn(*a, **kw)
            forwards[0] += 1
            inside[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                inside[0] -= 1
        return counted

    runner.forward = counting(runner.forward)
    if hasattr(runner, "forward_batch"):
        runner.forward_batch = counting(runner.forward_batch)
    return forwards


def run_config(model, batch: int, budget: int, rounds: int = 4, cuda_graphs: bool = False,
               prompt_len: int = 64, num_blocks: int = 8192, seed: int = 0) -> dict:
    """One configuration: per-forward times (ms, medians over the timed rounds), statuses, fan-out, transfers."""
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

    runner, capture_s = make_runner(model, num_blocks, cuda_graphs)
    device = runner.device
    vocab = model.config.vocab_size
    drafter = SSDDrafter(runner, vocab_size=vocab, options={"backup": "jit", "fanout_budget": budget})

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forwards = count_forwards(runner)
    gen = torch.Generator().manual_seed(seed)
    ctx = {f"r{i}": torch.randint(2, vocab - 2, (prompt_len,), generator=gen).tolist() for i in range(batch)}
    resp = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, K, SamplingSpec()) for r, c in ctx.items()], []))
    times = {"glue": [], "branch_step": [], "jit": [], "answer": []}
    statuses: collections.Counter = collections.Counter()
    fanouts, planned, branch_steps, transfers, counted_forwards = [], [], 0, 0, 0
    for rnd in range(rounds + 2):  # round 0: warm-up; rounds 1..rounds: timed; the last: transfers counted
        warm, counted = rnd == 0, rnd == rounds + 1
        counter = _transfer_counter(device.type) if counted else None
        if counter is not None:
            counter.__enter__()
        forwards[0] = 0
        drafter.answered()
        first = True
        while drafter.busy:
            before = forwards[0]
            sync()
            t0 = time.perf_counter()
            drafter.advance()
            sync()
            dt = time.perf_counter() - t0
            if forwards[0] > before:
                if not first:
                    branch_steps += not warm and not counted
                if not warm and not counted:
                    times["glue" if first else "branch_step"].append(dt)
                if first:
                    fanouts.append(list(getattr(drafter, "_fanout", []) or []))
                first = False
        hit = rnd % 2 == 0
        rows = []
        for j, (rid, c) in enumerate(ctx.items()):
            cached = {t for d, t in drafter.cache.outcomes(rid) if d == len(resp.drafts[j])}
            bonus = min(cached) if hit and cached else next(t for t in range(2, vocab) if t not in cached)
            rows.append(RowUpdate(rid, len(c), resp.drafts[j] + [bonus], K))
            ctx[rid] = c + resp.drafts[j] + [bonus]
        answer_forwards = forwards[0]
        sync()
        t0 = time.perf_counter()
        resp = drafter.step(StepRequest(rnd + 2, rows, []))
        sync()
        dt = time.perf_counter() - t0
        answer_forwards = forwards[0] - answer_forwards
        if counter is not None:
            counter.__exit__(None, None, None)
            transfers, counted_forwards = counter.total, forwards[0]
        elif not warm:
            statuses.update(resp.row_status)
            planned.append(resp.ssd["budget"])
            if answer_forwards:
                times["jit"].append(dt / answer_forwards)
            elif "hit" in resp.row_status:
                times["answer"].append(dt)
    static = getattr(runner, "static", None)  # the static decode path (static_forward.py), where on
    out = {"batch": batch, "budget": budget, "cuda_graphs": cuda_graphs, "rounds": rounds,
           "attention": runner.attention_impl, "graph_mode": runner.graph_mode, "capture_s": round(capture_s, 2),
           "static_runs": sum(static.runs.values()) if static is not None else 0,
           "graphs_captured": static.graphs if static is not None else [],
           "hits": statuses["hit"], "jit_misses": statuses["jit"],
           "statuses": dict(statuses), "branch_steps": branch_steps,
           "fanout": fanouts[-1] if fanouts else [], "planned_budget": max(planned, default=0),
           "transfers_per_forward": round(transfers / max(counted_forwards, 1), 2)}
    out.update({f"{name}_ms": _ms(values) for name, values in times.items()})
    return out
