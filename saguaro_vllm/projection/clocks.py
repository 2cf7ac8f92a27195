"""The replay's clocks: where the times the policy sees come from (projection/replay.py).

`TraceClock` answers with what the trace recorded (the live run's own cost model, to the microsecond);
`ModelClock` computes every time from a `CostModel` on a virtual timeline (its draft forwards drawn from the
spread of SSD's own runs where the model has one, `draft_forward.ssd`): the answer is sent at 0, the
pre-draft's forwards (glue, then the planned branch steps) run back to back, the next request arrives after
the modelled verification (times the model's `drafting_factor` of the batch: the pre-draft runs beside it,
which slows it where the drafter shares hardware with the target), and a forward in flight when it arrives finishes first (the
lateness).
"""
from __future__ import annotations

import random

from saguaro_vllm.drafter.trace import BRANCH, GLUE, NOW
from saguaro_vllm.projection.cost_model import CostModel

Forward = tuple[int, int, float]  # tokens fed, logit rows, seconds


def _forwards(rec: dict, phase: str) -> list[Forward]:
    return [(f[1], f[2], f[3]) for f in rec.get("fwd", []) if f[0] == phase]


class TraceClock:
    """Every time as the trace recorded it."""

    def __init__(self, steps: list[dict]):
        self.steps = steps

    def next_request(self, batch: int, served: list[int]) -> None:
        """(The recorded verification needs nothing from the replay.)"""

    def round(self, n: int, plan: dict | None) -> tuple[float, float, dict]:
        rec, prev = self.steps[n], self.steps[n - 1]
        pre = {"forwards": _forwards(prev, BRANCH), "steps_done": prev.get("pre", {}).get("steps_done", 0)}
        return rec.get("verify_s", 0.0), rec.get("late_s", 0.0), pre

    def glue_forward(self, n: int, rounds: list) -> Forward | None:
        """The glue's first forward (of one per part, `glue_forwards`)."""
        glue = _forwards(self.steps[n], GLUE)
        return glue[0] if glue else None

    def glue_forwards(self, n: int, rounds: list) -> list[Forward]:
        """The glue's forwards as recorded (one per part; none: the request came first)."""
        return _forwards(self.steps[n], GLUE)

    def reaches_plan(self, n: int) -> bool:
        return "plan" in self.steps[n].get("pre", {})

    def selected(self, n: int, roots: int) -> int:
        """Roots whose candidates were selected before the request came (the rest got no fan-out)."""
        return self.steps[n].get("pre", {}).get("selected", roots)

    def glue_time(self, n: int, glue: list[Forward]) -> float:
        """The glue's whole time, candidate selection included, as the live drafter measured it."""
        return self.steps[n].get("pre", {}).get("glue_s", sum(f[2] for f in glue))

    def now_forwards(self, n: int, jobs: dict[int, int], feeds: dict[int, int]) -> list[Forward]:
        return _forwards(self.steps[n], NOW)

    def answer_s(self, n: int, now: list[Forward], batch: int) -> float:
        return self.steps[n].get("answer_s", 0.0)

    def period(self, n: int, verify_s: float, late_s: float, prev_answer_s: float) -> float:
        """Seconds from step n-1's request to step n's, as measured."""
        return self.steps[n]["t"] - self.steps[n - 1]["t"]


class ModelClock:
    """Every time from the cost model, on a virtual timeline per round; with the cost model's measured
    spread (`jitter`), each verification and forward is its modelled mean times a factor drawn from it (a
    pre-draft cut short by one slow verification is not the mean's: the hit rate and the lateness depend on
    the spread, not only on the means)."""

    def __init__(self, cost: CostModel, finish_predraft: bool = False, seed: int = 0):
        self.cost = cost
        self.finish_predraft = finish_predraft
        self.rng = random.Random(seed)
        self.arrival = 0.0  # the next request's arrival after the answer: the verification the drafter sees
        self.glue_s = 0.0
        # the draft forward's spread this clock draws from: SSD's own runs' where the model has one
        self._draft_kind = "draft_forward.ssd" if "draft_forward.ssd" in cost.jitter else "draft_forward"

    def next_request(self, batch: int, served: list[int]) -> None:
        """The answer is out: the verification of `batch` rows with `served` drafts each starts."""
        tokens_per_row = sum(1 + d for d in served) / max(1, batch)
        self.arrival = self.cost.drafting_factor(batch) * (
            self._spread("target_verify", self.cost.verify_s(batch, tokens_per_row)) + self.cost.overhead("proposer", batch))
        self.glue_s = 0.0

    def _spread(self, kind: str, seconds: float) -> float:
        factors = self.cost.jitter.get(kind)
        return seconds * self.rng.choice(factors) if factors else seconds

    def _forward(self, tokens: int, logits: int) -> float:
        return self._spread(self._draft_kind, self.cost.forward_s(tokens, logits))

    def round(self, n: int, plan: dict | None) -> tuple[float, float, dict]:
        t = self.glue_s
        forwards: list[Forward] = []
        late = max(0.0, t - self.arrival)
        if plan is not None:
            t += self.cost.overhead("predraft", plan["rows"])
            while len(forwards) < plan["steps"] and (t < self.arrival or self.finish_predraft):
                step_s = self._spread(self._draft_kind, self.cost.branch_step_s(plan["rows"], len(plan["roots"])))
                t += step_s
                forwards.append((plan["rows"], plan["rows"], step_s))
            late = max(late, t - self.arrival)
        return self.arrival, late, {"forwards": forwards, "steps_done": len(forwards)}

    def glue_forward(self, n: int, rounds: list) -> Forward | None:
        tokens = sum(1 if (r.k and not r.fast) else r.k + 1 for r in rounds)
        logits = sum(1 if (r.k and not r.fast) else r.k + 1 for r in rounds)
        self.glue_s = self._forward(tokens, logits)
        return tokens, logits, self.glue_s

    def reaches_plan(self, n: int) -> bool:
        return self.glue_s < self.arrival or self.finish_predraft

    def selected(self, n: int, roots: int) -> int:
        """(The candidate selection is part of the modelled glue: done once the plan is reached.)"""
        return roots

    def glue_time(self, n: int, glue: list[Forward]) -> float:
        return sum(f[2] for f in glue)

    def glue_forwards(self, n: int, rounds: list) -> list[Forward]:
        """The glue as one modelled forward."""
        return [self.glue_forward(n, rounds)]

    def now_forwards(self, n: int, jobs: dict[int, int], feeds: dict[int, int]) -> list[Forward]:
        """`SyncDrafter._draft_chains`: the first forward feeds each row's chunk, each later one the rows
        still drafting, one logit row per row."""
        out: list[Forward] = []
        if not jobs:
            return out
        for s in range(max(jobs.values())):
            live = [i for i, more in jobs.items() if more > s]
            tokens = sum(feeds.get(i, 1) for i in live) if s == 0 else len(live)
            out.append((tokens, len(live), self._forward(tokens, len(live))))
        return out

    def answer_s(self, n: int, now: list[Forward], batch: int) -> float:
        return self.cost.overhead("drafter", batch) + sum(f[2] for f in now)

    def period(self, n: int, verify_s: float, late_s: float, prev_answer_s: float) -> float:
        return prev_answer_s + verify_s + late_s
