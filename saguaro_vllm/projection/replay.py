"""Replay a recorded SSD run through the product's own policy code, on a virtual clock.

Per recorded step the replay makes every decision `SSDDrafter` makes, with the same objects and in the same
order: a `RoundPlanner` (its measurements, the pre-draft plan, whether branch steps pay, the fan-out, the
per-row backup choice `draft_now`, the depth choice) fed the replay's own times instead of measured ones,
and the online Saguaro C choice. What cannot depend on costs comes from the trace: each round's verification
outcome (accepted count, bonus token) and where the bonus ranked among the predictor's candidates. A row
hits when its round's branches, as this replay planned them, include the recorded outcome (its rank below
the fan-out of its depth: covered) and at least one branch step ran before the request arrived.

Two clocks:
- `TraceClock`: every time as recorded (verification, lateness, each forward, answer). Under it the replay
  takes exactly the live run's decisions, hit for hit (tests/test_projection.py checks it on a real run).
- `ModelClock`: times from a `CostModel`; the pre-draft's forwards run back to back from the answer, the
  request arrives after the modelled verification, a forward in flight finishes first (lateness), and the
  branch steps done by then are what the lookup finds.
Where the replay's choice differs from the live one (an n-gram backup where the run drafted, fewer drafts),
the recorded outcome belongs to other drafts; such rounds take an outcome drawn from the trace's rounds of
the same kind and draft count (`OutcomePool`), so each kind keeps its measured acceptance and rank profile.
"""
from __future__ import annotations

import dataclasses
import random
from collections import Counter

from saguaro_vllm.drafter.backup import draft_now_candidates
from saguaro_vllm.drafter.predictor import MAX_RANK
from saguaro_vllm.drafter.round_planner import RoundPlanner
from saguaro_vllm.drafter.scale_choice import ScaleChoice
from saguaro_vllm.drafter.trace import WIDTH
from saguaro_vllm.projection.clocks import ModelClock, TraceClock

HIT, JIT, NGRAM, NEW = "hit", "jit", "ngram", "new"
LOOKED_UP = (HIT, JIT, NGRAM)


@dataclasses.dataclass
class _Round:
    """What the replay sent a request: the round its next lookup is against."""

    k: int
    fast: bool
    step: int  # index of the step record whose answer sent it
    want: int = 0  # drafts the row wanted (a round of zero drafts: the steps its branches draft)
    temp: float = 0.0  # the request's temperature (its fan-out's calibrated statistics)
    planned: bool = False  # the pre-draft reached its plan (ranks are observed at the lookup)
    fan: list[int] | None = None  # branches per depth as planned (the branch steps run or skipped)
    branched: bool = False  # the branch steps ran
    steps_done: int = 0  # branch tokens drafted before the next request came


class OutcomePool:
    """The trace's looked-up outcomes by kind ("neural", "ngram", "zero") and draft count: (a, rank, bonus);
    per kind also the ranks of rounds whose drafts were all accepted (`full`)."""

    def __init__(self, steps: list[dict], seed: int = 0):
        self.pool: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
        self.full: dict[str, list[int]] = {}
        self.rng = random.Random(seed)
        for s in steps:
            for r in s["rows"]:
                if r.get("a", -1) >= 0 and r["st"] in LOOKED_UP:
                    kind = self.kind(r.get("fast", False), r["k"])
                    self.pool.setdefault((kind, r["k"]), []).append((r["a"], r.get("rank", -1), r.get("t", -1)))
                    if r["k"] and r["a"] == r["k"]:
                        self.full.setdefault(kind, []).append(r.get("rank", -1))

    @staticmethod
    def kind(fast: bool, k: int) -> str:
        return "zero" if k == 0 else "ngram" if fast else "neural"

    def draw(self, fast: bool, k: int) -> tuple[int, int, int]:
        kind = self.kind(fast, k)
        same = self.pool.get((kind, k)) or [o for (kd, _), v in self.pool.items() if kd == kind for o in v]
        if not same:
            return 0, WIDTH, -1  # never measured: nothing accepted, the bonus not among the candidates
        a, rank, t = self.rng.choice(same)
        if a <= k:
            return a, rank, t
        # Deeper than k drafts: all k accepted. Such a bonus follows the target at depth k with nothing
        # excluded, like that of a recorded round whose drafts were all accepted: its rank is drawn from
        # those (-1, never a hit, where there are none). Always -1 would make a cut-short hit sent short
        # miss at the next lookup whenever its drafts were all accepted.
        full = self.full.get(kind)
        return (k, self.rng.choice(full), -1) if full else (k, -1, -1)


@dataclasses.dataclass
class ReplayResult:
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    per_step: list[dict] = dataclasses.field(default_factory=list)  # status per row, plan, depth
    #: per step: the replay's clock at its end (0 until the counted steps) and each row's committed tokens
    step_times: list[float] = dataclasses.field(default_factory=list)
    row_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    hits_by_depth: Counter = dataclasses.field(default_factory=Counter)
    lookups_by_depth: Counter = dataclasses.field(default_factory=Counter)
    budgets: Counter = dataclasses.field(default_factory=Counter)
    depths: Counter = dataclasses.field(default_factory=Counter)
    scales: Counter = dataclasses.field(default_factory=Counter)

    @property
    def hit_rate(self) -> float | None:
        n = sum(self.lookups_by_depth.values())
        return sum(self.hits_by_depth.values()) / n if n else None


class SSDReplay:
    def __init__(self, header: dict, steps: list[dict], clock: TraceClock | ModelClock, seed: int = 0,
                 count_from: int = 0):
        """`count_from`: the first step whose request the result counts (earlier steps, e.g. a warm-up, are
        replayed for the policy's state only)."""
        self.header, self.steps, self.clock = header, steps, clock
        self.count_from = count_from
        self._counting = False
        self.opts = dict(header.get("options") or {})
        self.planner = RoundPlanner(self.opts)
        self.scale_choice = ScaleChoice() if self.opts.get("sampling_scale") == "auto" else None
        self.pool = OutcomePool(steps, seed)
        self.rounds: dict[str, _Round] = {}
        self.result = ReplayResult()

    @property
    def predictor(self):
        return self.planner.predictor

    def run(self) -> ReplayResult:
        for n, rec in enumerate(self.steps):
            self._step(n, rec)
        return self.result

    # ---- one step: the mirror of SSDDrafter.step -------------------------------------------------------
    def _step(self, n: int, rec: dict) -> None:
        rows = rec["rows"]
        self._counting = n > self.count_from
        ran_branches = self._ran_branches
        if n > 0:
            verify_s, late_s, pre = self.clock.round(n, self._predraft_plan)
            self._finish_predraft(pre)
            self.planner.observe_round(verify_s, late_s, ran_branches)
        else:
            verify_s = late_s = 0.0
        depth = self.planner.choose_depth(len(rows), max((r.get("nd", 0) for r in rows), default=0), verify_s)
        if self._counting:
            self.result.depths[depth or 0] += 1
        status, served, misses, topups, tokens, planned, covered = self._lookups(rows)
        committed = None
        if verify_s > 0 and NEW not in status and rows:
            committed = sum(t for t, s in zip(tokens, status) if s in (HIT, JIT))
            self.planner.measure_rate(committed, verify_s)
        predrafted = self.planner.predrafted  # False: no pre-draft ran for this step, every miss is drafted now
        sync_like = not predrafted
        jit_rows, topup_rows, fast = self._back_up(rows, status, served, misses, topups, sync_like)
        jobs = {i: len(served[i]) for i in jit_rows} | dict(topup_rows)
        now_fwd = self.clock.now_forwards(n, jobs, {i: rows[i].get("feed", 1) for i in jit_rows})
        for f in now_fwd:
            self.planner.record_forward(f[0], f[2], logits=f[1])
        answer_s = self.clock.answer_s(n, now_fwd, len(rows))
        self._served = [len(d) for d in served]
        looked_up = [s for s in status if s in LOOKED_UP]
        self.planner.end_step(answer_s, sum(1 + d for d in self._served), looked_up.count(HIT), len(looked_up),
                              jit=bool(jit_rows), all_hit=not jit_rows and HIT in status, ran_branches=ran_branches,
                              planned=planned, covered=covered, committed=committed, verify_s=verify_s)
        roots = self._send_rounds(n, rows, status, fast)
        self.clock.next_request(len(rows), self._served)
        self._predraft(n, roots)
        committed = [tokens[i] if s in LOOKED_UP else 0 for i, s in enumerate(status)]
        if self._counting:
            self.result.tokens += sum(committed)
            self.result.seconds += self.clock.period(n, verify_s, late_s, self._prev_answer_s)
            self.result.steps += 1
        self.result.step_times.append(self.result.seconds)
        self.result.row_tokens.append(committed)
        self._prev_answer_s = answer_s
        self.result.per_step.append({"status": status, "depth": depth, "verify_s": verify_s, "late_s": late_s,
                                     "answer_s": answer_s, "plan": self._plan_log, "predrafted": predrafted})

    def _lookups(self, rows):
        status, served, misses, topups, tokens = [], [], [], [], []
        planned = covered = 0
        for i, r in enumerate(rows):
            rnd = self.rounds.pop(r["id"], None)
            st, drafts = r["st"], 0
            tokens.append(r.get("new", 0))
            served.append([])
            if rnd is None:  # no round: a new request to the drafter (or one without drafts)
                status.append(NEW if st in LOOKED_UP else st)
                if "feed" in r or (st in LOOKED_UP and r.get("want", 0) > 0):
                    misses.append(i)
                continue
            a, rank = self._outcome(rnd, r)
            if a >= 0:
                tokens[i] = a + 1
                if rnd.k:
                    self.predictor.observe(a, rnd.k, fast_backup=rnd.fast)
                if rnd.fast:
                    self.predictor.ngram_tokens.observe(a + 1)
                    self.predictor.ngram_matched.observe(a + 1)
                if rnd.planned and not rnd.fast and rank >= 0:
                    self.planner.observe_rank(r.get("temp", 0.0), a, rnd.k, min(rank, MAX_RANK))
                if self._counting:
                    self.result.lookups_by_depth[a] += 1
            # rank WIDTH: not among the recorded candidates, so never covered, whatever the fan-out
            cover = a >= 0 and rnd.fan is not None and 0 <= rank < min(rnd.fan[a], WIDTH)
            if a >= 0 and rnd.fan is not None:
                planned += 1
                covered += cover
            hit = cover and rnd.branched and rnd.steps_done > 0
            if self.scale_choice is not None and r.get("scale") is not None and a >= 0 and rnd.branched:
                self.scale_choice.observe(r.get("temp", 0.0), r["scale"], a + 1, missed=not hit)
            if hit:
                if self._counting:
                    self.result.hits_by_depth[a] += 1
                want = self._want(r)
                keep = min(rnd.steps_done, want)
                drafts = keep
                if keep < want:
                    topups.append((i, want - keep))
                status.append(HIT)
            else:
                status.append(JIT)
                misses.append(i)
            served[i] = [0] * drafts
        return status, served, misses, topups, tokens, planned, covered

    def _outcome(self, rnd: _Round, r: dict) -> tuple[int, int]:
        """The round's (accepted, rank): as recorded when the live run sent the same kind and number of
        drafts, else drawn from the trace's rounds of this kind (`OutcomePool`)."""
        if rnd.fast == bool(r.get("fast", False)) and rnd.k == r.get("k"):
            return r.get("a", -1), r.get("rank", -1)
        a, rank, _ = self.pool.draw(rnd.fast, rnd.k)
        return a, rank

    def _want(self, r: dict) -> int:
        """Drafts the row may get: K (its `num_drafts`), or this step's depth with `depth: "auto"`; a row the
        live run gave none (no context, at the length limit) gets none."""
        if r.get("want", 0) <= 0 and r["st"] not in LOOKED_UP and "feed" not in r:
            return 0
        nd = r.get("nd") or r.get("want") or self.header.get("k") or 0
        return min(nd, self.planner.depth) if self.planner.depth is not None else nd

    def _back_up(self, rows, status, served, misses, topups, sync_like: bool = False):
        """`SSDDrafter._back_up` / `_choose_draft_now`: which misses and cut-short hits are drafted now
        (`sync_like`: every miss, as after a round that did not pre-draft)."""
        ngram_on = self.planner.needs_ngram_drafts() and not sync_like
        has_ngram = {i: rows[i].get("ng", 0) > 0 for i in misses} if ngram_on else {}
        now: list[int] = list(misses) if sync_like else []
        if (misses or topups) and not sync_like:
            missed = {i: (rows[i].get("feed", 1), self._want(rows[i]), bool(has_ngram.get(i))) for i in misses}
            hits = {i: len(served[i]) for i, x in enumerate(status) if x == HIT}
            cands, base = draft_now_candidates(len(rows), missed, hits, topups, {i: len(served[i]) for i, _ in topups},
                                               self.predictor.neural.alpha, self.predictor.ngram_matched.mean)
            now = self.planner.draft_now(cands, base)
        chosen = set(now)
        jit_rows = [i for i in misses if i in chosen]
        topup_rows = [(i, more) for i, more in topups if i in chosen]
        fast = set(misses) - chosen
        for i in fast:
            ng = min(rows[i].get("ng", 0), rows[i].get("want", 0)) if ngram_on else 0
            served[i] = [0] * ng
            if not ng:
                self.predictor.ngram_tokens.observe(1)
            status[i] = NGRAM if status[i] == JIT else status[i]
        for i in jit_rows:
            served[i] = [0] * self._want(rows[i])
        for i, more in topup_rows:
            served[i] = served[i] + [0] * more
        return jit_rows, topup_rows, fast

    def _send_rounds(self, n, rows, status, fast) -> list[str]:
        roots = []
        for i, r in enumerate(rows):
            k = self._served[i]
            if not k and i not in fast:
                continue
            self.rounds[r["id"]] = _Round(k, i in fast and k > 0, n, want=self._want(r), temp=r.get("temp", 0.0))
            roots.append(r["id"])
            if self.scale_choice is not None and r.get("temp", 0.0) > 0 and not (i in fast):
                scale = self.scale_choice.choose(r["temp"], self.planner.verify_s or 1.0, self.planner.miss_cost_s())
                if self._counting:
                    self.result.scales[scale] += 1
        return roots

    # ---- the pre-draft: the mirror of PreDrafter._predraft_rounds ------------------------------------------
    _ran_branches = False
    _predraft_plan: dict | None = None
    _plan_log: list | None = None
    _served: list[int] = []
    _prev_answer_s = 0.0

    def _predraft(self, n: int, roots: list[str]) -> None:
        """Glue forward, then plan, pays and fan-outs (the branch steps' timing is the clock's, at the next
        request)."""
        self._ran_branches, self._predraft_plan, self._plan_log = False, None, None
        if not roots:
            return
        k = max(self.rounds[r].want or self.rounds[r].k for r in roots)
        if not self.planner.predraft_next(len(roots), k):
            return  # drafted as `sync` does after the verification (the planner's fallback)
        glue = self.clock.glue_forwards(n, [self.rounds[r] for r in roots])
        if not glue:
            return  # the request came before the glue ran
        for f in glue:
            self.planner.record_forward(f[0], f[2], logits=f[1])
        if not self.clock.reaches_plan(n):  # cut short in the glue: it took at least what elapsed, as live
            self.planner.switch.observe_glue(len(roots), self.clock.glue_time(n, glue))
            return
        # steps per branch: the drafts the next round wants, as live (`PreDrafter`), not this round's count
        # (a hit cut short to 3 drafts would plan 3-step branches where the live run plans 5)
        if self.planner.next_plan is not None:  # planned with the round, as live
            plan, pays = self.planner.next_plan
        else:
            plan = self.planner.plan(len(roots), k)
            pays = self.planner.branches_pay_off(plan, len(roots), k)
        fans = [self.planner.fanout_for(self.rounds[r].k, self.rounds[r].fast, plan.branches, self.rounds[r].temp)
                for r in roots]
        self._plan_log = [plan.branches, plan.steps, pays]
        selected = self.clock.selected(n, len(roots))
        for rid, fan in zip(roots[:selected], fans):  # fan-outs planned whether or not the steps run (the
            rnd = self.rounds[rid]                     # planner's coverage), for the roots selected, as live
            rnd.planned = True
            rnd.fan = fan
        self.planner.switch.observe_glue(len(roots), self.clock.glue_time(n, glue))
        if selected < len(roots):
            return  # the request came during the candidate selection: no branch steps
        if self._counting or n == self.count_from:
            self.result.budgets[plan.branches if pays else 0] += 1
        if not pays:
            return
        self._ran_branches = True
        rows = 0
        for rid in roots:
            rnd = self.rounds[rid]
            rnd.branched = True
            rows += sum(rnd.fan)
        self._predraft_plan = {"roots": roots, "steps": plan.steps, "rows": rows}

    def _finish_predraft(self, pre: dict | None) -> None:
        """The clock says how many branch steps ran before the request came (their forwards feed the cost
        model, as live)."""
        plan = self._predraft_plan
        if plan is None or pre is None:
            return
        parents = len(plan["roots"])
        for f in pre["forwards"]:
            self.planner.record_forward(f[0], f[2], logits=f[1], parents=min(parents, f[0]))
        for rid in plan["roots"]:
            if rid in self.rounds:
                self.rounds[rid].steps_done = pre["steps_done"]


__all__ = ["SSDReplay", "ReplayResult", "OutcomePool", "TraceClock", "ModelClock"]
