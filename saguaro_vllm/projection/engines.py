"""What a trace measured, and the engines projected from its outcomes under a cost model.

- `measured`: tokens per second and cache hit rate of the traced run itself, over its traced steps (from
  the first request's arrival to the last one's; the prompts' prefill and the last verification are outside).
- `project_ssd`: `SSDReplay` under a `ModelClock` (the product's policy on the virtual clock).
- `project_spec` (Saguaro `sync` and vLLM `draft_model`) and `project_ar`: no policy to replay; each step
  verifies K drafts per row (or none) and commits the trace's neural outcomes (accepted + 1 per row; rows
  whose live round had no neural drafts draw one from the trace's neural rounds; a request's first step, a
  prefill, commits no verified tokens, as in `measured` and the SSD replay). A step's period is the
  drafting after the step before plus its verification, as `measured` counts it. `sync` pays the
  proposer's and the drafter's host overheads and K batched draft forwards; `draft_model` pays K draft
  forwards of the same cost model in the target's process and its own step overhead.
- `tile`: a trace's steps at another batch size (rows repeated, or the first B kept), so that one trace at
  batch b projects batch 1-64; each copy of the rows runs the trace from another step, so that a step's rows
  have different outcomes, as a real batch's would.
"""
from __future__ import annotations

import copy
import statistics

from saguaro_vllm.projection.clocks import ModelClock, TraceClock
from saguaro_vllm.projection.cost_model import CostModel, trace_temperature
from saguaro_vllm.projection.replay import LOOKED_UP, OutcomePool, ReplayResult, SSDReplay


def _summary(engine: str, batch: int, tokens: int, seconds: float, extra: dict | None = None) -> dict:
    rate = tokens / seconds if seconds > 0 else 0.0
    return {"engine": engine, "batch": batch, "tokens_per_s": round(rate, 3),
            "per_seq_tokens_per_s": round(rate / max(1, batch), 3), **(extra or {})}


def per_request_rate(steps: list[dict], times: list[float], tokens: list[list[int]], count_from: int = 0
                     ) -> float | None:
    """Tokens per second per request the way the engine's per-sequence figure counts them (its tokens after
    the first over the time from its first token to its last): per request that arrives at step `count_from`
    or later, the tokens of its steps after its first (`tokens[n][i]`: row i of step n) over `times` (each
    step's end, on the run's clock) from its first step to its last; the mean over the requests. Unlike
    tokens/s over the batch, this holds when a speculative batch's requests finish at different steps (at
    batch 16 on the cost-matched pair a step had 9-14 rows on average): comparing vLLM AR, whose requests all
    run to the end together, with the batch total over 16 would put AR ahead of `sync` at batch 16 in the
    projection while it was behind in the runs."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    made: dict[str, int] = {}
    seen_before = {r["id"] for s in steps[:count_from] for r in s["rows"]}
    for n in range(count_from, len(steps)):
        for i, r in enumerate(steps[n]["rows"]):
            rid = r["id"]
            if rid in seen_before:
                continue
            if rid in first:
                made[rid] += tokens[n][i]
            else:
                first[rid], made[rid] = times[n], 0
            last[rid] = times[n]
    rates = [made[rid] / (last[rid] - first[rid]) for rid in first if last[rid] > first[rid]]
    return round(statistics.mean(rates), 3) if rates else None


def _ssd_extra(r: ReplayResult) -> dict:
    by_depth = {str(a): round(r.hits_by_depth[a] / n, 4) for a, n in sorted(r.lookups_by_depth.items()) if n}
    return {"hit_rate": None if r.hit_rate is None else round(r.hit_rate, 4), "hit_rate_by_depth": by_depth,
            "budget_chosen": dict(sorted((str(k), v) for k, v in r.budgets.items())),
            "depth_chosen": dict(sorted((str(k), v) for k, v in r.depths.items())),
            "scale_chosen": dict(sorted((str(k), v) for k, v in r.scales.items())), "steps": r.steps}


def measured(header: dict, steps: list[dict], count_from: int = 0) -> dict:
    """The traced run's own tokens per second (and hit rate for `async`) over its traced steps from
    `count_from` on."""
    steps = steps[count_from:]
    tokens = sum(r["new"] for s in steps[1:] for r in s["rows"] if r["st"] != "new")
    seconds = steps[-1]["t"] - steps[0]["t"] if len(steps) > 1 else 0.0
    batch = round(sum(len(s["rows"]) for s in steps) / max(1, len(steps)))
    extra: dict = {"steps": len(steps) - 1, "per_request_tokens_per_s": per_request_rate(
        steps, [s["t"] for s in steps], [[r["new"] if r["st"] != "new" else 0 for r in s["rows"]] for s in steps])}
    if header.get("mode") == "async":
        looked = [r for s in steps[1:] for r in s["rows"] if r["st"] in LOOKED_UP]
        extra["hit_rate"] = round(sum(r["st"] == "hit" for r in looked) / len(looked), 4) if looked else None
    return _summary(f"saguaro-{header.get('mode')}", batch, tokens, seconds, extra)


def live_replay(header: dict, steps: list[dict], count_from: int = 0) -> dict:
    """The replay under the trace's own timings: must equal `measured` (a check of the replay itself)."""
    r = SSDReplay(header, steps, TraceClock(steps), count_from=count_from).run()
    return _summary("saguaro-async", round(sum(len(s["rows"]) for s in steps) / len(steps)), r.tokens, r.seconds,
                    {**_ssd_extra(r), "per_request_tokens_per_s": per_request_rate(steps, r.step_times, r.row_tokens,
                                                                                   count_from)})


def segment_starts(steps: list[dict]) -> list[int]:
    """Indices of the steps where every row is new to the drafter: where a group of requests begins (e.g.
    a benchmark's warm-up, then its measured group)."""
    return [i for i, s in enumerate(steps) if s["rows"] and all(r["st"] == "new" for r in s["rows"])]


def tile(steps: list[dict], batch: int) -> list[dict]:
    """The steps (those with rows) with `batch` rows each: row j is row j mod b of copy j // b (b: the trace's
    largest batch), and copy c of C runs the trace from c/C of its length on, wrapping around (each pass a
    new request: `id#c` on the first pass, `id#c.p` on pass p). So the rows of one step carry the outcomes of
    different steps, as a real batch's rows would. Repeating every row at the same step would make all rows
    of a step hit or miss together and 64 copies of one outcome swamp the online acceptance estimate (batch
    64, T=1: one step of a=0 read as acceptance 0.00, every miss left to its n-gram drafts and SSD projected
    at 0.67x `sync`). A step whose source step has fewer rows than b
    lacks those rows; step-level fields are the unshifted step's."""
    steps = [s for s in steps if s["rows"]]
    n_steps = len(steps)
    b = max((len(s["rows"]) for s in steps), default=1)
    copies = -(-batch // b)
    out = []
    for n, s in enumerate(steps):
        t = copy.copy(s)
        t["rows"], pre_rows = [], {}
        for j in range(batch):
            c, i = divmod(j, b)
            m = n + c * n_steps // copies
            src = steps[m % n_steps]
            if i >= len(src["rows"]):
                continue
            r = dict(src["rows"][i])
            rid, r["id"] = r["id"], f"{r['id']}#{c}" if m < n_steps else f"{r['id']}#{c}.{m // n_steps}"
            t["rows"].append(r)
            if rid in src.get("pre", {}).get("rows", {}):
                pre_rows[r["id"]] = src["pre"]["rows"][rid]
        if "rows" in s.get("pre", {}):
            t["pre"] = {**s["pre"], "rows": pre_rows}
        out.append(t)
    return out


#: Replays averaged when the cost model has a measured spread (each draws its own times).
REPEATS = 16


def project_ssd(header: dict, steps: list[dict], cost: CostModel, seed: int = 0, count_from: int = 0) -> dict:
    """SSD under the cost model; with a measured spread (`cost.jitter`) the mean of REPEATS replays, each
    drawing its own times (tokens over seconds summed over all of them), with each one's rate beside it."""
    opts = header.get("options") or {}
    cost = cost.at_temperature(trace_temperature(steps))
    total = None
    rates, per_request = [], []
    for i in range(REPEATS if cost.jitter else 1):
        clock = ModelClock(cost, finish_predraft=bool(opts.get("finish_predraft")), seed=seed + i)
        r = SSDReplay(header, steps, clock, seed + i, count_from=count_from).run()
        rates.append(round(r.tokens / r.seconds, 3) if r.seconds else 0.0)
        per_request.append(per_request_rate(steps, r.step_times, r.row_tokens, count_from))
        if total is None:
            total = r
        else:
            total.tokens += r.tokens
            total.seconds += r.seconds
            total.steps += r.steps
            for name in ("hits_by_depth", "lookups_by_depth", "budgets", "depths", "scales"):
                getattr(total, name).update(getattr(r, name))
    known = [x for x in per_request if x is not None]
    extra = {**_ssd_extra(total), **({"repeats": rates} if len(rates) > 1 else {}),
             "per_request_tokens_per_s": round(statistics.mean(known), 3) if known else None}
    return _summary("saguaro-async", len(steps[0]["rows"]) if steps else 0, total.tokens, total.seconds, extra)


def _neural_tokens(steps: list[dict], k: int, seed: int) -> list[list[int]]:
    """Per step after the first, per row: accepted + 1 of K neural drafts (the recorded outcome where the
    live round was neural with K drafts, else one drawn from such rounds); 0 for a request's first step
    (`new`: its prompt's prefill, no drafts verified; `measured` and the SSD replay count none either)."""
    pool = OutcomePool(steps, seed)
    out = []
    for s in steps[1:]:
        row_tokens = []
        for r in s["rows"]:
            if r["st"] == "new":
                row_tokens.append(0)
                continue
            neural = r["st"] in LOOKED_UP + ("drafted",) and r.get("a", -1) >= 0 and not r.get("fast") \
                and r.get("k") == k
            a = r["a"] if neural else pool.draw(False, k)[0]
            row_tokens.append(min(a, k) + 1)
        out.append(row_tokens)
    return out


def _first_feed(row: dict, tokens: int | None, k: int) -> int:
    """Tokens the first draft forward after a step feeds for `row`: a new request's prompt (the trace's
    `feed`; a `sync` trace records it as the row's `new` tokens), else the bonus (and x_K after a full
    accept: `tokens` == K + 1)."""
    if row["st"] == "new":
        return int(row.get("feed", row.get("new", 1)))
    return 2 if tokens == k + 1 else 1


def project_spec(engine: str, steps: list[dict], k: int, cost: CostModel, seed: int = 0,
                 count_from: int = 0) -> dict:
    """Saguaro `sync` or vLLM `draft_model`: K drafts per row every step, drafted after the verification.
    Step n's period is the drafting after step n-1 plus step n's verification, as `measured` counts it
    (from the arrival of step `count_from`'s request to the last one's) and the SSD replay (`period`): so
    the drafting after step `count_from` is in, that after the last step out. A request's first step feeds
    its prompt in the first draft forward (pairing the drafting with its own step's verification instead
    would leave out the first counted drafting, in a batch-1 trace its prompt's, 108 tokens, count the one
    after the last step, and feed 1 token for a `sync` trace's new rows, which have no `feed`)."""
    tokens = seconds = 0.0
    if engine == "saguaro-sync":  # (vLLM draft_model verifies through vLLM's own path at every temperature)
        cost = cost.at_temperature(trace_temperature(steps))
    fv, fd = cost.mean_factor("target_verify"), cost.mean_factor("draft_forward")  # sums: the spread's mean
    outcome = [None, *_neural_tokens(steps, k, seed)]  # per step: accepted + 1 per row (none for the first)
    times = [0.0] * len(steps)  # each step's end on the projected clock
    for n in range(count_from + 1, len(steps)):
        prev, row_tokens = steps[n - 1]["rows"], outcome[n]
        pb, b = len(prev), len(row_tokens)
        first = sum(_first_feed(r, None if outcome[n - 1] is None else outcome[n - 1][i], k)
                    for i, r in enumerate(prev))
        draft = fd * (cost.forward_s(first, pb) + (k - 1) * cost.forward_s(pb, pb)) if pb else 0.0
        host = (cost.overhead("drafter", pb) + cost.overhead("proposer", b) if engine == "saguaro-sync"
                else cost.overhead("vllm_draft_model", b))
        tokens += sum(row_tokens)
        seconds += fv * cost.verify_s(b, 1 + k) + draft + host
        times[n] = seconds
    per_request = per_request_rate(steps, times, [[0] * len(steps[0]["rows"]) if steps else [], *outcome[1:]],
                                   count_from)
    return _summary(engine, len(steps[0]["rows"]) if steps else 0, int(tokens), seconds,
                    {"per_request_tokens_per_s": per_request})


def project_ar(batch: int, cost: CostModel) -> dict:
    """vLLM AR: one target step of one token per row (the verify curve's depth 0: vLLM's own sampler, which
    the temperature factors, measured on Saguaro's verification path, do not describe)."""
    return _summary("vllm-ar", batch, batch, cost.mean_factor("target_verify") * cost.verify_s(batch, 1.0))
