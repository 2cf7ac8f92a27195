"""The cost model a replay runs under: what the target's verification, a draft forward and the host work
around them cost, each number with the source it came from (a measurement on this machine, a public figure,
an assumption). Loaded from and written to JSON (docs/projection.md has the schema).

The verification is a table (batch, tokens per row) -> seconds, interpolated piecewise linearly in tokens
per row and in batch (extrapolated from the nearest two points); a draft forward is the drafter's own
linear model (`predictor.StepCostModel`: fixed + per token fed + per logit row).

The verification's cost depends on the temperature where the sampling path does: an all-greedy batch with a
Saguaro drafter is verified by argmax without vLLM's copies (patches/greedy_rejection.py), a sampled one by
vLLM's rejection sampler (on the cost-matched demo pair at batch 16, ~250 ms against ~460 ms per step on this
CPU). `temperature_factors` scale the table per temperature and batch (measured from runs at that
temperature, `calibrate`); `at_temperature` gives the model a run at one temperature replays under.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import json
from pathlib import Path

from saguaro_vllm.drafter.predictor import StepCostModel
from saguaro_vllm.drafter.trace import BRANCH, GLUE

SCHEMA = 1
#: Host overheads of the cost model (seconds), each {"value": ..., "source": ...}; missing ones count as 0.
OVERHEADS = {
    "proposer_step_s": "Saguaro engines: per step, the proposer's packing, both messages and its reading of the "
                       "answer, on top of the target's verification (what the drafter's verify_s adds)",
    "proposer_row_s": "the same per row",
    "drafter_step_s": "per step, the drafter's answer host time beyond its draft forwards",
    "drafter_row_s": "the same per row",
    "predraft_step_s": "per round, the pre-draft's time beyond its forwards (planning, candidates, the branches' "
                       "admission: what comes before and between its branch steps)",
    "predraft_row_s": "the same per branch row planned (each branch's fork and candidate)",
    "vllm_draft_model_step_s": "vLLM draft_model: per step, host time of its in-process drafting beyond the forwards",
}


#: Times that may carry a measured spread (`CostModel.jitter`): "draft_forward.ssd" is the draft forward in
#: SSD's runs, whose drafter works beside the target (where it shares hardware with it, slower than in
#: `sync`'s); the SSD replay draws from it where the model has it, else from "draft_forward".
JITTER = ("target_verify", "draft_forward", "draft_forward.ssd")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), extrapolated from the nearest two points."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0


@dataclasses.dataclass
class CostModel:
    #: (batch, tokens per row) -> seconds of one verification step of the target (vLLM's step, no drafter)
    verify: dict[int, dict[float, float]]
    draft: StepCostModel
    overheads: dict[str, float]
    sources: dict[str, str]
    name: str = "cost model"
    #: optional measured spread: "target_verify" / "draft_forward" -> factors (measured / modelled) that a
    #: replay draws from per verification / forward; none: every time is its model's mean
    jitter: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    #: optional: temperature -> batch -> factor on `verify` for runs at that temperature (T = 0: all greedy)
    temperature_factors: dict[float, dict[int, float]] = dataclasses.field(default_factory=dict)
    #: optional: what a pre-draft's branch step costs beyond its requests' own rows (a branch step reads each
    #: request's shared prefix once: on a CPU 16 rows forked from one request cost a third of 16 requests' own
    #: rows, 10.5 against 34.6 ms for the demo draft at 256 tokens in `saguaro-vllm calibrate`): fixed per step (e.g. the
    #: branches' sampling) + per further branch row (`branch_step_s`); None: `draft` for every forward
    branch: StepCostModel | None = None
    #: optional: batch -> factor on the target's verification in SSD, whose drafter pre-drafts beside it (the
    #: glue forward in every round, branch steps in most), where the two share hardware (in the demo-pair
    #: traces of `benchmarks/validate_projection.py` on 2 cores SSD's verification took 132-152 ms at batch 1
    #: against `sync`'s 113-123 ms, whose drafter waits during it); a drafter on a device of its own: none
    drafting_factors: dict[int, float] = dataclasses.field(default_factory=dict)

    def drafting_factor(self, batch: int) -> float:
        """`drafting_factors` at `batch`, interpolated and held at the ends (1 without any)."""
        if not self.drafting_factors:
            return 1.0
        bs = sorted(self.drafting_factors)
        return _interp([float(b) for b in bs], [self.drafting_factors[b] for b in bs],
                       float(min(max(batch, bs[0]), bs[-1])))

    def at_temperature(self, temperature: float) -> CostModel:
        """The model for a run at `temperature`: `verify` times the factors of the nearest measured temperature
        of the same kind (0: greedy; > 0: sampled), interpolated in batch and held at the ends; the model
        itself where no factor of that kind was measured."""
        same = [t for t in self.temperature_factors if (t > 0) == (temperature > 0)]
        if not same:
            return self
        factors = self.temperature_factors[min(same, key=lambda t: abs(t - temperature))]
        bs = sorted(factors)

        def factor(b: int) -> float:
            return _interp([float(x) for x in bs], [factors[x] for x in bs], float(min(max(b, bs[0]), bs[-1])))

        verify = {b: {x: s * factor(b) for x, s in curve.items()} for b, curve in self.verify.items()}
        return dataclasses.replace(self, verify=verify, temperature_factors={})

    # ---- costs -------------------------------------------------------------------------------------
    def verify_s(self, batch: int, tokens_per_row: float) -> float:
        """Seconds of the target's verification of `batch` rows of `tokens_per_row` tokens (1 + drafts)."""
        batches = sorted(self.verify)
        at = []
        for b in batches:
            curve = self.verify[b]
            xs = sorted(curve)
            at.append(_interp(xs, [curve[x] for x in xs], tokens_per_row))
        return max(1e-6, _interp([float(b) for b in batches], at, float(batch)))

    def forward_s(self, tokens: int, logits: int) -> float:
        """A draft forward over requests' own rows (`tokens` fed, `logits` rows computed)."""
        return self.draft.forward_s(tokens, logits)

    def branch_step_s(self, rows: int, parents: int) -> float:
        """A pre-draft branch step: `rows` one-token branch rows forked from `parents` requests. Each request's
        prefix is read once, like one row of its own (`draft`), and each further branch adds what a forked
        row adds (`branch`'s per row): the demo draft's 128-row steps over 16 requests took 66 ms in the
        demo-pair traces of `benchmarks/validate_projection.py`, this gives 66 (16 rows of their own 33.9 ms + 112 x 0.29 ms), forks of one request
        alone 43."""
        if self.branch is None:
            return self.draft.forward_s(rows, rows)
        parents = max(1, min(parents, rows))
        extra = self.branch.fixed_s + (self.branch.per_row_s + self.branch.per_logit_s) * (rows - parents)
        return self.draft.forward_s(parents, parents) + extra

    def mean_factor(self, kind: str) -> float:
        """The mean of a measured spread (1 without one): what a sum of many such times is scaled by."""
        factors = self.jitter.get(kind)
        return sum(factors) / len(factors) if factors else 1.0

    def overhead(self, name: str, batch: int = 0) -> float:
        """Step overhead `name` ("proposer", "drafter", ...): per-step value + per-row value x batch."""
        return self.overheads.get(f"{name}_step_s", 0.0) + batch * self.overheads.get(f"{name}_row_s", 0.0)

    # ---- JSON ----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA, "name": self.name,
            "target_verify": {"source": self.sources.get("target_verify", ""),
                              "points": [{"batch": b, "tokens_per_row": t, "s": s}
                                         for b in sorted(self.verify) for t, s in sorted(self.verify[b].items())],
                              **({"by_temperature": {
                                  "source": self.sources.get("target_verify.by_temperature", ""),
                                  "factors": [{"temperature": t, "batch": b, "factor": round(f, 4)}
                                              for t in sorted(self.temperature_factors)
                                              for b, f in sorted(self.temperature_factors[t].items())]}}
                                 if self.temperature_factors else {}),
                              **({"while_drafting": {"source": self.sources.get("target_verify.while_drafting", ""),
                                                     "factors": [{"batch": b, "factor": round(f, 4)}
                                                                 for b, f in sorted(self.drafting_factors.items())]}}
                                 if self.drafting_factors else {})},
            "draft_forward": {"source": self.sources.get("draft_forward", ""), "fixed_s": self.draft.fixed_s,
                              "per_token_s": self.draft.per_row_s, "per_logit_s": self.draft.per_logit_s},
            **({"branch_forward": {"source": self.sources.get("branch_forward", ""), "fixed_s": self.branch.fixed_s,
                                   "per_token_s": self.branch.per_row_s, "per_logit_s": self.branch.per_logit_s}}
               if self.branch is not None else {}),
            "overheads": {k: {"value": v, "source": self.sources.get(k, "")} for k, v in self.overheads.items()},
            "jitter": {k: {"factors": [round(f, 4) for f in v], "source": self.sources.get(f"jitter.{k}", "")}
                       for k, v in self.jitter.items()},
        }

    @classmethod
    def from_json(cls, obj: dict) -> CostModel:
        """Parse and check a cost model; every number must say where it came from."""
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"cost model schema {obj.get('schema')!r}, expected {SCHEMA}")
        sources: dict[str, str] = {}
        verify: dict[int, dict[float, float]] = {}
        tv, df = obj["target_verify"], obj["draft_forward"]
        for name, block in (("target_verify", tv), ("draft_forward", df)):
            if not block.get("source"):
                raise ValueError(f"cost model: {name} has no source")
            sources[name] = block["source"]
        for p in tv["points"]:
            verify.setdefault(int(p["batch"]), {})[float(p["tokens_per_row"])] = float(p["s"])
        if not verify:
            raise ValueError("cost model: target_verify has no points")
        temperature_factors: dict[float, dict[int, float]] = {}
        if "by_temperature" in tv:
            block = tv["by_temperature"]
            if not block.get("source") or not block.get("factors"):
                raise ValueError("cost model: target_verify.by_temperature needs factors and a source")
            sources["target_verify.by_temperature"] = block["source"]
            for f in block["factors"]:
                temperature_factors.setdefault(float(f["temperature"]), {})[int(f["batch"])] = float(f["factor"])
        drafting_factors: dict[int, float] = {}
        if "while_drafting" in tv:
            block = tv["while_drafting"]
            if not block.get("source") or not block.get("factors") or any(
                    not float(f["factor"]) > 0 for f in block["factors"]):
                raise ValueError("cost model: target_verify.while_drafting needs factors > 0 by batch and a source")
            sources["target_verify.while_drafting"] = block["source"]
            drafting_factors = {int(f["batch"]): float(f["factor"]) for f in block["factors"]}
        overheads = {}
        for key, item in obj.get("overheads", {}).items():
            if key not in OVERHEADS:
                raise ValueError(f"cost model: unknown overhead {key!r}; known: {', '.join(OVERHEADS)}")
            if not item.get("source"):
                raise ValueError(f"cost model: overhead {key} has no source")
            overheads[key], sources[key] = float(item["value"]), item["source"]
        jitter = {}
        for key, item in obj.get("jitter", {}).items():
            if key not in JITTER or not item.get("source") or not item.get("factors"):
                raise ValueError(f"cost model: jitter {key!r} needs factors and a source (keys: {', '.join(JITTER)})")
            jitter[key], sources[f"jitter.{key}"] = [float(f) for f in item["factors"]], item["source"]
        draft = StepCostModel(float(df["fixed_s"]), float(df["per_token_s"]), float(df.get("per_logit_s", 0.0)))
        branch = None
        if "branch_forward" in obj:
            bf = obj["branch_forward"]
            if not bf.get("source"):
                raise ValueError("cost model: branch_forward has no source")
            sources["branch_forward"] = bf["source"]
            branch = StepCostModel(float(bf["fixed_s"]), float(bf["per_token_s"]), float(bf.get("per_logit_s", 0.0)))
        return cls(verify, draft, overheads, sources, obj.get("name", "cost model"), jitter, temperature_factors,
                   branch, drafting_factors)

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def trace_temperature(steps: list[dict]) -> float:
    """The run's temperature: the most common among a trace's rows (a benchmark worker's warm-up request may
    run at another one)."""
    temps = collections.Counter(r.get("temp", 0.0) for s in steps for r in s["rows"])
    return temps.most_common(1)[0][0] if temps else 0.0


def step_temperature(rows: list[dict]) -> float:
    """The temperature a step's verification ran at: 0 when every row is greedy (the all-greedy path), else
    the highest."""
    return max((r.get("temp", 0.0) for r in rows), default=0.0)


def verifications(steps: list[dict], with_temperature: bool = False) -> list[tuple]:
    """(batch, tokens per row sent, drafter-seen seconds[, the step's temperature]) of each traced verification
    that is a decode step of the target. A step with a `new` row is left out: its verify_s also holds that request's prompt
    prefill (0.86-0.93 s against 0.10-0.13 s for the decode steps of the demo-pair traces), which no verify
    curve or replay step models; one such sample per trace raised the pooled verification factor of the
    calibrated model by 9 % (0.630 -> 0.686) and a trace's own mean by 13 %."""
    out, prev = [], None
    for s in steps:
        if (prev is not None and s.get("verify_s", 0) > 0 and prev["rows"]
                and not any(r.get("st") == "new" for r in s["rows"])):
            b = len(prev["rows"])
            sample = (b, sum(1 + r.get("served", 0) for r in prev["rows"]) / b, s["verify_s"])
            out.append((*sample, step_temperature(prev["rows"])) if with_temperature else sample)
        prev = s
    return out


def verify_samples(steps: list[dict], into: dict | None = None) -> dict[tuple[int, float], list[float]]:
    """The drafter-seen verification times of a trace's decode steps by (batch, tokens per row sent,
    rounded)."""
    sums = {} if into is None else into
    for b, tpr, v in verifications(steps):
        sums.setdefault((b, float(round(tpr))), []).append(v)
    return sums


def mean_curve(sums: dict[tuple[int, float], list[float]]) -> dict[int, dict[float, float]]:
    verify: dict[int, dict[float, float]] = {}
    for (b, t), v in sums.items():
        verify.setdefault(b, {})[t] = sum(v) / len(v)  # the mean: throughput is a mean
    return verify


def predraft_host_samples(steps: list[dict]) -> list[tuple[int, float]]:
    """(branch rows planned, seconds) of the pre-draft's time beyond its forwards, in each round whose branch
    steps the next request cut short: the drafter was busy from its answer until it took that request, so
    the verification it saw plus its lateness, less the glue and the branch steps, is the rest (planning,
    candidates, the branches' forks, and with a trace its recording of candidates: in the demo-pair
    traces of `benchmarks/validate_projection.py` about 5.7 ms + 0.2 ms per branch row, 9 ms at batch 1 and ~50 ms at batch 16,
    which a replay without it spends on branch steps). A round that finished its steps before the request
    came gives no sample (its idle time is unknown), nor does a verification that holds a prompt's
    prefill."""
    out = []
    for prev, s in zip(steps, steps[1:]):
        pre, fwd = prev.get("pre", {}), prev.get("fwd", [])
        branch = [f for f in fwd if f[0] == BRANCH]
        if (not pre.get("pays") or not branch or "plan" not in pre or pre.get("steps_done", 0) >= pre["plan"][1]
                or not s.get("verify_s") or any(r.get("st") == "new" for r in s["rows"])):
            continue
        busy = s["verify_s"] + s.get("late_s", 0.0) - sum(f[3] for f in fwd if f[0] in (GLUE, BRANCH))
        out.append((branch[0][1], max(0.0, busy)))
    return out


def predraft_overheads(samples: list[tuple[int, float]]) -> dict[str, float]:
    """`predraft_step_s` and `predraft_row_s` fitted to `predraft_host_samples` (none from fewer than 3)."""
    if len(samples) < 3:
        return {}
    fit = StepCostModel.fit(samples)
    return {"predraft_step_s": fit.fixed_s, "predraft_row_s": fit.per_row_s}


def from_trace(header: dict, steps: list[dict], name: str = "fitted from the trace") -> CostModel:
    """The cost model a trace itself measured: the draft forward fitted to its forwards, the verification
    (as the drafter saw it: target + proposer + transport) by batch and tokens per row sent, the answer's host
    time beyond its forwards. Sources say so; the proposer overhead is folded into the verification."""
    forwards = [(f[1], f[2], f[3]) for s in steps for f in s.get("fwd", []) if f[0] != BRANCH]
    # branch steps as (rows, parents, seconds): what a branch adds beyond its request is fitted on what the
    # step took beyond its requests' own rows (`CostModel.branch_step_s`)
    branched = [(f[1], s.get("pre", {}).get("batch", 1), f[3]) for s in steps for f in s.get("fwd", [])
                if f[0] == BRANCH]
    draft = StepCostModel.fit_forwards(forwards) if len(forwards) >= 3 else StepCostModel(0.0, 0.0)
    branch = None
    if len(branched) >= 3:
        branch = StepCostModel.fit([(rows - parents, sec - draft.forward_s(parents, parents))
                                    for rows, parents, sec in branched])
    sums = verify_samples(steps)
    verify = mean_curve(sums)
    host = [s["answer_s"] - sum(f[3] for f in s.get("fwd", []) if f[0] == "now") for s in steps if "answer_s" in s]
    src = f"measured in trace ({header.get('mode')}, {len(steps)} steps)"
    own = CostModel({1: {1.0: 0.0}}, draft, {}, {}, branch=branch)
    jitter = {"draft_forward": [f[2] / max(draft.forward_s(f[0], f[1]), 1e-9) for f in forwards]
              + [sec / max(own.branch_step_s(rows, parents), 1e-9) for rows, parents, sec in branched],
              "target_verify": [v / verify[b][t] for (b, t), vs in sums.items() for v in vs if verify[b][t] > 0]}
    jitter = {k: v for k, v in jitter.items() if v}
    overheads = {"drafter_step_s": max(0.0, sum(host) / len(host)) if host else 0.0}
    overheads.update(predraft_overheads(predraft_host_samples(steps)))
    sources = {"target_verify": src + ": the drafter's verify_s (mean per batch and tokens per row)",
               "draft_forward": src + ": least squares over its forwards but the branch steps",
               "branch_forward": src + ": least squares of its branch steps beyond their requests' own rows "
                                       "against their further rows", "drafter_step_s": src,
               "predraft_step_s": src + ": rounds cut short, least squares against the branch rows planned",
               "predraft_row_s": src + ": rounds cut short, least squares against the branch rows planned",
               "jitter.target_verify": src + ": each verification over its mean",
               "jitter.draft_forward": src + ": each forward over the fit"}
    return CostModel(verify or {1: {1.0: 0.0}}, draft, overheads, sources, name, jitter, branch=branch)
