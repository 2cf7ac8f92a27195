"""`saguaro-vllm calibrate`: this machine's cost model for a pair, as JSON for `saguaro-vllm project`.

- draft forward by rows, of two kinds, timed here with the drafter's own runner pinned to its core, the least
  of 3 interleaved passes (`least_disturbed`), each fitted like the drafter's own online model
  (`StepCostModel.fit_forwards`): requests' own rows (`distinct_step_s`: jit drafts, `sync`, the glue) and a
  pre-draft's branch rows (`step_s`: N branches forked from one request, one token each, also used by
  benchmarks/experiments/bench_draft_step.py), which share their prefix and cost far less per row on a CPU;
- target verification by batch and tokens per row: a verify-curve JSON (benchmarks/verify_curve.py, vLLM's
  step with a free oracle drafter), or the drafter-seen verification of traces;
- with a verify curve and traces, the verification per temperature and batch: the traces' drafter-seen
  verification over the curve's (`temperature_factors`, from the `sync` traces where there are any: it holds
  the proposer's and the transport's share), and SSD's verification beside its pre-draft over that
  (`drafting_factors`, per batch); `--no-by-temperature`: one proposer overhead per step pooled over the
  traces instead;
- host overheads from traces of real runs: the drafter's answer time beyond its forwards (per step and row)
  and the pre-draft's time beyond its forwards (per round and branch row, from SSD rounds cut short).
"""
from __future__ import annotations

import functools
import json
import logging
import statistics
import time
from pathlib import Path

from saguaro_vllm.drafter.predictor import StepCostModel
from saguaro_vllm.drafter.trace import BRANCH, read_trace
from saguaro_vllm.projection.cost_model import (CostModel, from_trace, mean_curve, predraft_host_samples,
                                                 predraft_overheads, verifications, verify_samples)

logger = logging.getLogger("saguaro_vllm.projection")


@functools.lru_cache(maxsize=32)
def _read_version(path: str, mtime_ns: int, size: int) -> tuple[dict, list[dict]]:
    return read_trace(path)


def _read(path: str | Path) -> tuple[dict, list[dict]]:
    """`read_trace`, once per file version: a calibration reads every trace for several of its parts (the
    mode, the temperature and drafting factors, the overheads, the spread), each otherwise a full decompress
    and parse. Callers must not change what it returns."""
    st = Path(path).stat()
    return _read_version(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def step_s(runner, prefix: int, rows: int, reps: int) -> float:
    """Median seconds of one forward over `rows` branches forked at `prefix` from the request "parent",
    one new token each (two warm-up forwards first)."""
    ids = [f"b{rows}-{i}" for i in range(rows)]
    for i in ids:
        runner.fork("parent", i, prefix)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        runner.forward([(i, [7], prefix) for i in ids])
        runner.synchronize()
        times.append(time.perf_counter() - t0)
        for i in ids:
            runner.truncate(i, prefix)
    for i in ids:
        runner.free_request(i)
    return statistics.median(times[2:])


def distinct_step_s(runner, prefix: int, rows: int, reps: int) -> float:
    """Median seconds of one forward over `rows` requests of their own (different contexts of `prefix` tokens,
    as a jit draft or a `sync` step feeds them), one new token each (two warm-up forwards first). On a CPU
    these cost several times `step_s`'s forked rows (the demo draft at 256 tokens, 16 rows: 34.6 against
    10.5 ms in `saguaro-vllm calibrate`): timing only forks would make every multi-row jit forward of a
    replay ~2x too cheap."""
    ids = [f"d{rows}-{i}" for i in range(rows)]
    for n, i in enumerate(ids):
        runner.add_request(i)
        runner.forward([(i, [5 + (n * 31 + j) % 97 for j in range(prefix)], 0)], max_tokens_per_seq=prefix)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        runner.forward([(i, [7], prefix) for i in ids])
        runner.synchronize()
        times.append(time.perf_counter() - t0)
        for i in ids:
            runner.truncate(i, prefix)
    runner.free_many(ids)
    return statistics.median(times[2:])


def least_disturbed(time_rows, rows_list: list[int], passes: int) -> list[dict]:
    """{"rows", "s"} per row count: the least of `passes` timings (`time_rows(rows)`), the row counts
    interleaved in each pass. Another job's load only ever slows a forward, so the least timing is the
    forward's own cost and a burst does not bend the fitted shape; the load the runs saw comes from the
    traces (`jitter_from_traces`). On a shared machine one pass can give e.g. 1 / 4 / 8 / 32 rows:
    8.3 / 21.2 / 9.8 / 40.1 ms, then minutes later 15.3 / 12.6 / 8.8 / 16.1 ms (a fit of 0.02 ms per row:
    branch rows nearly free, where the runs' 10-row branch forwards cost 1.3x their one-row ones)."""
    best: dict[int, float] = {}
    for _ in range(max(1, passes)):
        for r in rows_list:
            best[r] = min(best.get(r, float("inf")), time_rows(r))
    return [{"rows": r, "s": best[r]} for r in rows_list]


def measure_draft(draft: str, rows_list: list[int], prefix: int = 256, reps: int = 6, dtype: str = "auto",
                  linear: str = "auto", device: str = "cpu", core: int | None = None, passes: int = 3,
                  branch_rows: list[int] | None = None) -> tuple[StepCostModel, list[dict], StepCostModel, list[dict]]:
    """Time the draft forward at each row count (pinned to `core`, as the drafter is; the least of `passes`
    interleaved timings: `least_disturbed`), over requests' own rows (`distinct_step_s`) and over forked
    branch rows (`step_s`, at `branch_rows`, default `rows_list`); the two fitted models and their points."""
    import torch

    if core is not None:
        from saguaro_vllm.shared.placement import pin_process

        pin_process([core])

    from saguaro_vllm.drafter.kv_cache import KVCacheConfig
    from saguaro_vllm.drafter.model.linear_kernels import install_linear_kernel, resolve_linear
    from saguaro_vllm.drafter.model.loader import load_draft_model
    from saguaro_vllm.drafter.runner import DraftModelRunner

    if dtype == "auto":  # the drafter's own choice on a CPU (config.py: `dtype`)
        from saguaro_vllm.frontend.resolve import cpu_has_bf16_matmul

        dtype = "bfloat16" if device == "cpu" and cpu_has_bf16_matmul() else "float32"
    kind = resolve_linear(linear, device, dtype)
    model = load_draft_model(draft, dtype=getattr(torch, dtype), device=device)
    install_linear_kernel(model, kind)
    branch_rows = list(branch_rows or rows_list)
    blocks = (prefix // 16 + 2) * (max(rows_list) + max(branch_rows) + 1) + 16
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=blocks, block_size=16))
    runner.add_request("parent")
    runner.forward([("parent", [5 + i % 97 for i in range(prefix)], 0)], max_tokens_per_seq=prefix)
    forked = least_disturbed(lambda r: step_s(runner, prefix, r, reps), branch_rows, passes)
    runner.free_request("parent")
    points = least_disturbed(lambda r: distinct_step_s(runner, prefix, r, reps), rows_list, passes)

    def fit(pts: list[dict]) -> StepCostModel:
        return StepCostModel.fit_forwards([(p["rows"], p["rows"], p["s"]) for p in pts])

    own, forks = fit(points), fit(forked)
    # what forked rows add beyond their request's own row (`CostModel.branch_step_s`): the forks' line at one
    # row less the requests' own, and their slope
    extra = StepCostModel(max(0.0, forks.step_s(1) - own.step_s(1)), forks.per_row_s, forks.per_logit_s)
    return own, points, extra, forked


def verify_from_curve(path: str | Path) -> dict[int, dict[float, float]]:
    """(batch -> tokens per row -> seconds) from benchmarks/verify_curve.py's JSON."""
    obj = json.loads(Path(path).read_text())
    out: dict[int, dict[float, float]] = {}
    for p in obj["points"]:
        out.setdefault(int(p["batch"]), {})[float(1 + p["depth"])] = p["verify_ms"] / 1e3
    return out


#: Verifications of one run at one temperature and batch that a temperature factor needs.
MIN_SAMPLES = 5


def plain_traces(traces: list[str]) -> list[str]:
    """The traces whose drafter waits during the verification (`sync`), or all where there is none: what
    the verification per temperature and batch is measured on (`drafting_factors` has SSD's)."""
    return [t for t in traces if _read(t)[0].get("mode") == "sync"] or list(traces)


def temperature_factors(traces: list[str], verify: dict) -> dict[float, dict[int, float]]:
    """Per temperature and batch: the traced verification (as the drafter saw it: target, proposer and
    transport) over the verify curve's, the mean of the runs' ratios (each run weighing the same; a step's
    temperature is its rows': 0 when all are greedy; a run's ratio needs MIN_SAMPLES steps). The verify
    curve's free oracle drafter takes vLLM's path at T=0; Saguaro's runs take the all-greedy verification
    there and vLLM's sampled rejection at T > 0, so one factor per temperature cannot be pooled over
    temperatures or batches (on the demo-pair traces a pooled proposer overhead read -18..-26 % at batch 1
    and +11..+30 % at 16). `calibrate` gives it the `sync` traces only (`plain_traces`)."""
    probe = CostModel(verify, StepCostModel(0.0, 0.0), {}, {})
    ratios: dict[tuple[float, int], list[float]] = {}
    for path in traces:
        _, steps = _read(path)
        sums: dict[tuple[float, int], list[float]] = {}  # per (the step's temperature, batch)
        for b, tpr, v, temp in verifications(steps, with_temperature=True):
            acc = sums.setdefault((temp, b), [0.0, 0.0, 0])
            acc[0] += v
            acc[1] += probe.verify_s(b, tpr)
            acc[2] += 1
        for key, (measured_s, modelled_s, n) in sums.items():
            if n >= MIN_SAMPLES:  # (a batch a run passes through for a step or two as its requests finish)
                ratios.setdefault(key, []).append(measured_s / modelled_s)
    out: dict[float, dict[int, float]] = {}
    for (temp, b), r in sorted(ratios.items()):
        out.setdefault(temp, {})[b] = statistics.mean(r)
    return out


def drafting_factors(traces: list[str], cost: CostModel) -> dict[int, float]:
    """What SSD's pre-draft beside the target (the glue forward in every round, branch steps in most) adds
    to its verification, per batch: each `async` trace's verifications over the model's (the verify curve
    times the temperature factors of the `sync` runs, whose drafter waits meanwhile), the mean of the runs'
    ratios (each run weighing the same, MIN_SAMPLES steps of a run at a batch). 1 where the drafter has
    hardware of its own. Where the two share cores SSD's verification runs slower than `sync`'s: in the
    demo-pair traces on 2 cores (`benchmarks/validate_projection.py`) 132-152 ms (medians) against 113-123 ms
    at batch 1, level at batch 16, and one verification per temperature and batch for both modes projected
    `sync` 6-15 % low and SSD up to 20 % high."""
    ratios: dict[int, list[float]] = {}
    at_temp: dict[float, CostModel] = {}
    for path in traces:
        header, steps = _read(path)
        if header.get("mode") != "async":
            continue
        samples = verifications(steps, with_temperature=True)
        for t in {x[3] for x in samples} - at_temp.keys():
            at_temp[t] = cost.at_temperature(t)
        by_batch: dict[int, list[float]] = {}
        for b, tpr, v, t in samples:
            by_batch.setdefault(b, []).append(v / (at_temp[t].verify_s(b, tpr) + at_temp[t].overhead("proposer", b)))
        for b, r in by_batch.items():
            if len(r) >= MIN_SAMPLES:
                ratios.setdefault(b, []).append(statistics.mean(r))
    return {b: statistics.mean(r) for b, r in sorted(ratios.items())}


def overheads_from_traces(traces: list[str], verify: dict | None) -> tuple[dict[str, float], str]:
    """Drafter answer host time beyond forwards (fitted per step and row), the pre-draft's time beyond its
    forwards (per round and branch row, from the SSD rounds cut short: `predraft_host_samples`) and, with a
    target verify curve, the proposer's and the transport's share of the drafter-seen verification (mean
    per step)."""
    answer, extra, pre = [], [], []
    probe = CostModel(verify, StepCostModel(0.0, 0.0), {}, {}) if verify else None
    for path in traces:
        _, steps = _read(path)
        pre += predraft_host_samples(steps)
        for s in steps:
            if "answer_s" in s:
                fwd = sum(f[3] for f in s.get("fwd", []) if f[0] == "now")
                answer.append((len(s["rows"]), s["answer_s"] - fwd))
        if probe is not None:  # decode steps only: a new row's verification also holds its prompt's prefill
            extra += [v - probe.verify_s(b, tpr) for b, tpr, v in verifications(steps)]
    out: dict[str, float] = {}
    if answer:
        fit = StepCostModel.fit([(b, max(0.0, s)) for b, s in answer])
        out["drafter_step_s"], out["drafter_row_s"] = fit.fixed_s, fit.per_row_s
    out.update(predraft_overheads(pre))
    if extra:
        out["proposer_step_s"] = max(0.0, statistics.mean(extra))
    return out, f"measured in {len(traces)} trace(s): " + ", ".join(Path(t).name for t in traces)


#: Row counts of the timed branch steps (a pre-draft at batch 16 steps 128-256 rows).
BRANCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)

#: Factors per trace in a calibrated spread (its quantiles): every run weighs the same.
QUANTILES = 200


def _quantiles(values: list[float], n: int = QUANTILES) -> list[float]:
    """`n` evenly spaced quantiles of `values` (linear interpolation): the sample's distribution as n values."""
    v = sorted(values)
    out = []
    for i in range(n):
        x = (i + 0.5) / n * len(v) - 0.5
        lo = min(max(int(x), 0), len(v) - 1)
        hi = min(lo + 1, len(v) - 1)
        out.append(v[lo] + (v[hi] - v[lo]) * min(max(x - lo, 0.0), 1.0))
    return out


def pooled_spread(per_trace: list[list[float]], n: int = QUANTILES) -> list[float]:
    """One spread from several runs' factors (measured / modelled): each run's factors over their own mean
    (the spread within a run), as `n` quantiles, times the mean of the runs' means (the machine's level over
    the runs, each run weighing the same). Pooling the raw factors would weigh a run by its number of
    forwards and mix the runs' different loads into the spread: in one set of demo-pair traces the async
    T=1 run (638 of 1808 forwards, a burst of load: mean factor 1.57, median 1.21)
    raised the forward's pooled factor to 1.32 where three of the four runs measured 1.17-1.20, and a
    replay drew that run's slow forwards into every other run's steps."""
    runs = [f for f in per_trace if f]
    if not runs:
        return []
    level = statistics.mean(statistics.mean(f) for f in runs)
    return [level * q for f in runs for q in _quantiles([x / statistics.mean(f) for x in f], n)]


def jitter_from_traces(traces: list[str], cost: CostModel) -> dict[str, list[float]]:
    """The spread of real runs around the model: each traced verification (as the drafter saw it) over the
    model's verification plus proposer overhead, each traced draft forward over the model's forward, pooled
    with each run weighing the same (`pooled_spread`). Their mean also carries the load of the machine
    during the runs into the model.

    The draft forward's spread is taken per mode: `draft_forward` from the `sync` runs (their drafter works
    while the target waits), `draft_forward.ssd` from the SSD runs, whose drafter works beside the target's
    verification (glue and branch steps) and, where the two share hardware, runs slower: in demo-pair
    traces on 2 cores SSD's forwards at batch 1 were 1.2-1.5x the model where `sync`'s were 1.1-1.25x, and
    one pooled level projected SSD at batch 1, T > 0 15-20 % fast. Without `sync` runs the
    SSD runs give both."""
    verify, forward, ssd_forward = [], [], []
    at_temp: dict[float, CostModel] = {}
    for path in traces:
        header, steps = _read(path)
        ssd = header.get("mode") == "async"  # the model of SSD's verification holds the drafting factor
        (ssd_forward if ssd else forward).append(
            [f[3] / max(cost.branch_step_s(f[1], s.get("pre", {}).get("batch", 1)) if f[0] == BRANCH
                        else cost.forward_s(f[1], f[2]), 1e-9) for s in steps for f in s.get("fwd", [])])
        # decode steps only (`verifications`: a new row's verification also holds its prompt's prefill)
        samples = verifications(steps, with_temperature=True)
        for t in {x[3] for x in samples} - at_temp.keys():
            at_temp[t] = cost.at_temperature(t)
        run = [v / ((cost.drafting_factor(b) if ssd else 1.0)
                    * (at_temp[t].verify_s(b, tpr) + at_temp[t].overhead("proposer", b)))
               for b, tpr, v, t in samples]
        verify.append(run)
    return {k: v for k, v in (("target_verify", pooled_spread(verify)),
                              ("draft_forward", pooled_spread(forward or ssd_forward)),
                              ("draft_forward.ssd", pooled_spread(ssd_forward))) if v}


def calibrate(out: str, draft: str | None = None, verify_curve: str | None = None, traces: list[str] = (),
              rows: list[int] = (1, 2, 4, 8, 16, 32), name: str | None = None, core: int | None = None,
              by_temperature: bool = True) -> CostModel:
    """Build the cost model from what is given (see the module doc) and write it to `out`."""
    if not draft and not traces:
        raise ValueError("calibrate needs --draft (to time the draft forward) or --from-trace")
    sources: dict[str, str] = {}
    branch = None
    if draft:
        fit, points, branch, forked = measure_draft(draft, list(rows), core=core, branch_rows=BRANCH_ROWS)
        sources["draft_forward"] = (f"measured here: {Path(draft).name}, requests of their own at 256 tokens, rows "
                                    + ", ".join(f"{p['rows']}: {1e3 * p['s']:.2f} ms" for p in points))
        sources["branch_forward"] = (f"measured here: {Path(draft).name}, branches forked at 256 tokens, rows "
                                     + ", ".join(f"{p['rows']}: {1e3 * p['s']:.2f} ms" for p in forked))
    base = from_trace(*_read(traces[0])) if traces else None
    if not draft:
        fit, sources["draft_forward"] = base.draft, base.sources["draft_forward"]
        if base.branch is not None:
            branch, sources["branch_forward"] = base.branch, base.sources["branch_forward"]
    if verify_curve:
        verify = verify_from_curve(verify_curve)
        sources["target_verify"] = f"benchmarks/verify_curve.py: {Path(verify_curve).name}"
    elif base is not None:  # pooled over every trace: the verification as the drafters saw it
        sums: dict = {}
        for path in traces:
            verify_samples(_read(path)[1], sums)
        verify = mean_curve(sums)
        sources["target_verify"] = (f"measured in {len(traces)} trace(s): the drafter's verify_s (target + "
                                    "proposer + transport), mean per batch and tokens per row")
    else:
        raise ValueError("calibrate needs --verify-curve or --from-trace for the target's verification")
    overheads: dict[str, float] = {}
    factors: dict[float, dict[int, float]] = {}
    if traces and verify_curve and by_temperature:
        plain = plain_traces(list(traces))
        factors = temperature_factors(plain, verify)
        sources["target_verify.by_temperature"] = (
            f"measured in {len(plain)} trace(s){' of sync' if len(plain) < len(traces) else ''}: per temperature "
            "and batch, the mean over runs of the drafter-seen verification (target + proposer + transport) over "
            "the verify curve's")
    if traces:  # (with temperature factors the proposer's share is in them)
        overheads, src = overheads_from_traces(list(traces), verify if verify_curve and not factors else None)
        sources.update(dict.fromkeys(overheads, src))
    cost = CostModel(verify, fit, overheads, sources, name or "calibrated on this machine",
                     temperature_factors=factors, branch=branch)
    if traces and factors and len(plain) < len(traces):
        cost.drafting_factors = drafting_factors(list(traces), cost)
        if cost.drafting_factors:
            sources["target_verify.while_drafting"] = (
                f"measured in {len(traces) - len(plain)} async trace(s): per batch, SSD's verifications (its "
                "pre-draft running beside them) over this model's, whose temperature factors come from the sync "
                "runs (the mean over runs)")
    if traces:
        cost.jitter = jitter_from_traces(list(traces), cost)
        sources.update({f"jitter.{k}": f"measured in {len(traces)} trace(s) over this model: each run's factors "
                        f"over their mean as {QUANTILES} quantiles, times the mean of the runs' means "
                        f"(decode steps only for the verification)" for k in cost.jitter})
    cost.save(out)
    logger.info("cost model written to %s", out)
    return cost
