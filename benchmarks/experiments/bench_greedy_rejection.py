"""CPU time of vLLM's rejection sampler on an all-greedy batch: vLLM's own `forward` against the fast path of
`saguaro_vllm/patches/greedy_rejection.py` (same inputs, same outputs checked), one torch thread.

    .venv/bin/python benchmarks/experiments/bench_greedy_rejection.py --batch 16 64 --vocab 128256 --k 5 --reps 15 \
        --out benchmarks/results/experiments/2026-12-06-greedy-rejection-cpu.json

CPU time (`time.thread_time`, torch pinned to one thread so all the work is on this thread) is reported,
not wall time: the machine may be loaded; the load average is recorded with the result.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types

import numpy as np
import torch


def _setup():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    from saguaro_vllm.patches import apply_all

    apply_all()
    if current_platform.is_cpu() and not HAS_TRITON:
        current_platform.import_kernels()
        current_platform.register_triton_kernel_overrides()


def _inputs(batch, k, vocab, seed):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    gen = torch.Generator().manual_seed(seed)
    rows = batch * (k + 1)
    logits = torch.randn(rows, vocab, generator=gen)
    target = [r * (k + 1) + j for r in range(batch) for j in range(k)]
    target_t = torch.tensor(target, dtype=torch.int32)
    argmax = logits.argmax(-1)[target_t.long()]
    accept = torch.rand(len(target), generator=gen) < 0.8  # mixed accept / reject positions
    draft = torch.where(accept, argmax, torch.randint(0, vocab, (len(target),), generator=gen)).to(torch.int32)
    md = SpecDecodeMetadata(
        draft_token_ids=draft, num_draft_tokens=[k] * batch,
        cu_num_draft_tokens=torch.from_numpy(np.cumsum([k] * batch, dtype=np.int32)),
        cu_num_sampled_tokens=torch.from_numpy(np.cumsum([k + 1] * batch, dtype=np.int32)),
        target_logits_indices=target_t,
        bonus_logits_indices=torch.tensor([r * (k + 1) + k for r in range(batch)], dtype=torch.int32),
        logits_indices=torch.arange(rows, dtype=torch.int32))
    zeros = torch.zeros(batch)
    smd = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=zeros,
        presence_penalties=zeros, repetition_penalties=torch.ones(batch), output_token_ids=[[]] * batch,
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    return md, logits, smd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    _setup()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from saguaro_vllm.patches import greedy_rejection, original_of

    vllm_forward = original_of(greedy_rejection.SAMPLER, "forward")
    rs = RejectionSampler(Sampler(), None, torch.device("cpu"))
    greedy_rejection.mark_saguaro(types.SimpleNamespace(rejection_sampler=rs))
    load_before = os.getloadavg()
    results = []
    for batch in args.batch:
        md, logits, smd = _inputs(batch, args.k, args.vocab, seed=batch)
        assert greedy_rejection.fast_path_applies(rs, logits, smd)
        want = vllm_forward(rs, md, None, logits, smd).sampled_token_ids
        got = rs(md, None, logits, smd).sampled_token_ids
        assert torch.equal(want, got)
        times = {"vllm": [], "fast_path": []}
        for _ in range(args.reps):  # alternate, so that load changes hit both alike
            for name, fn in (("vllm", lambda: vllm_forward(rs, md, None, logits, smd)),
                             ("fast_path", lambda: rs(md, None, logits, smd))):
                t0 = time.thread_time()
                fn()
                times[name].append((time.thread_time() - t0) * 1e3)
        row = {"batch": batch, "k": args.k, "vocab": args.vocab, "reps": args.reps, "tokens_equal": True}
        for name, ts in times.items():
            row[f"{name}_cpu_ms_median"] = round(statistics.median(ts), 2)
            row[f"{name}_cpu_ms_min"] = round(min(ts), 2)
        row["speedup_median"] = round(row["vllm_cpu_ms_median"] / row["fast_path_cpu_ms_median"], 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {
        "what": "CPU time per call of RejectionSampler.forward, all-greedy batch, vLLM's own forward vs the "
                "Saguaro greedy fast path (saguaro_vllm/patches/greedy_rejection.py); torch 1 thread; "
                "fp32 logits [batch*(K+1), vocab]; ~80% of draft positions accepted",
        "command": " ".join([os.path.relpath(sys.executable)] + sys.argv),
        "clock": "time.thread_time (CPU time of the calling thread; torch.set_num_threads(1))",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
