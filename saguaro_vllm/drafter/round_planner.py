"""What the SSD drafter measures about its rounds and what it decides from it: pure policy, no model.

`RoundPlanner` holds the online measurements (verification time and the drafter's lateness on the shared
monotonic clock, draft forward costs, answer times, the batch's committed tokens per second, the cache hit
rate, acceptance and candidate ranks through `OutcomePredictor` / `RankEstimate`) and answers the
drafter's questions each round:
- how many branches and steps to pre-draft (`plan`), and whether the branch steps pay at all
  (`branches_pay_off`);
- the fan-out per depth of a round (`fanout_for`);
- which misses and cut-short hits to draft on the critical path (`draft_now`, per row);
- how many drafts each row gets (`choose_depth`, with `depth: "auto"`);
- whether the next round pre-drafts at all or drafts as `sync` does (`predraft_next`, `fallback.py`).
`SSDDrafter` feeds it what happened and does the model work; the rules themselves live in `backup.py`,
`predictor.py` and `depth_choice.py`. docs/algorithm.md explains each.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from saguaro_vllm.drafter.backup import DraftNow, choose_draft_now
from saguaro_vllm.drafter.depth_choice import DepthChoice
from saguaro_vllm.drafter.fallback import PreDraftSwitch
from saguaro_vllm.drafter.predictor import (
    MAX_RANK,
    OutcomePredictor,
    OutcomeStats,
    PreDraftPlan,
    RankEstimate,
    StepCostModel,
    branches_pay_off,
    plan_predraft,
)
from saguaro_vllm.drafter.scale_choice import temperature_bucket

logger = logging.getLogger("saguaro_vllm.drafter")

#: Share of the measured verification time the pre-draft plan may fill (the rest absorbs jitter; an
#: overrun costs at most the forward in flight, the rest of a cut-short branch becomes a top-up).
#: Measured: adapting it to keep ~20 % of rounds from overrunning lowered SSD's speed (21.8 vs 23.1
#: tokens/s on the cost-matched demo pair), since shorter plans mean top-ups on the critical path.
PLAN_SAFETY = 0.95
#: Forward timings kept for the step-cost model.
COST_SAMPLES = 64
#: Smoothing of the measured verification time, lateness, answer times and hit rate.
VERIFY_EMA = 0.3
#: Memory of the batch's long-run rate (`measure_rate`): each step's tokens and seconds weigh this much less
#: per later measured step (~10 steps).
RATE_DECAY = 0.9
#: After this many rounds in a row whose branch steps were skipped, one round runs them anyway, so the
#: measured hit rate that decides skipping is measured again (the workload may have changed).
PROBE_EVERY = 16
#: The hit rate measured over rounds that ran branch steps is kept as decayed counts of rows (hits and
#: lookups), each round's counts weighing this much less per later such round (a memory of ~10 rounds).
BRANCH_HIT_DECAY = 0.9
#: A plan's branch steps may be at most this many times the largest draft forward measured so far (in logit
#: rows): the cost model is not extrapolated far beyond its data, and each round's larger forward measures
#: the next size (at batch 1 budgets grow 2, 4, 8, ... in a few rounds).
GROWTH = 2
#: The cap of the automatic budget where the options do not give one (replays of traces, tests): the
#: config's default (`max_fanout_budget`; the drafter process does not import the front end, a test checks
#: the two agree).
MAX_FANOUT_BUDGET = 128
#: Share of one draft forward (of the batch's rows) a part of the pre-draft's candidate selection may take:
#: the answer waits at most that long for a selection in flight.
SELECT_SHARE = 0.5
#: Steps between re-plannings of the per-depth outlook of `depth: "auto"` (k_max plans each time).
OUTLOOK_EVERY = 8


def smooth(old: float | None, new: float) -> float:
    """Exponential moving average with weight VERIFY_EMA on the new value (the first value as is)."""
    return new if old is None else (1 - VERIFY_EMA) * old + VERIFY_EMA * new


class RoundPlanner:
    def __init__(self, options: dict):
        self.opts = options
        self.predictor = OutcomePredictor()
        self.ranks = RankEstimate()
        #: per temperature bucket: the calibrated outcome statistics neural rounds' fan-outs come from
        self.outcomes: dict[int, OutcomeStats] = {}
        #: measured draft forwards of the requests' own rows (glue, jit drafts, top-ups, `sync` drafting):
        #: (tokens fed, logit rows, seconds)
        self.costs: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=COST_SAMPLES)
        #: measured pre-draft branch steps: (rows, requests they were forked from, seconds)
        self.branch_costs: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=COST_SAMPLES)
        #: the last fits and the samples they were fitted on: a round asks for them several times (plan,
        #: pays, backups, depth) between forwards, and a fit of 64 samples takes ~0.4-0.5 ms of host time
        self._cost_fit: tuple[tuple, StepCostModel | None] = ((), None)
        self._branch_fit: tuple[tuple, StepCostModel | None] = ((), None)
        self.verify_s: float | None = None
        #: what the answer waits for a pre-draft forward in flight, in rounds that ran branch steps
        self.late_s: float | None = None
        self.answered_at: float | None = None  # time.monotonic(), the clock of StepRequest.sent_at
        #: answer time of steps whose misses were drafted just in time, and of steps that all hit: their
        #: difference is what a miss costs the online C choice
        self.answer_s: dict[str, float | None] = {"miss": None, "hit": None}
        #: committed tokens per second of the batch (answer + verification + lateness, decayed sums): the
        #: long-run rate the per-row backup choice weighs a row's gain against
        self.rate: float | None = None
        self._rate_sums = (0.0, 0.0)  # decayed tokens, decayed seconds
        self._round_late_s = 0.0  # the last round's lateness (part of its step's period)
        self.last_answer_s = 0.0
        self.hit_rate: float | None = None  # smoothed share of looked-up rows that hit
        #: the two parts of `branch_hit_floor`, as decayed row counts: of the looked-up rows whose round
        #: reached its plan, those whose outcome lay within the planned fan-out (`coverage`, every such
        #: round, its branch steps run or skipped); of the covered rows of rounds that ran branch steps,
        #: those that hit (`completion`)
        self._planned = 0.0
        self._covered = 0.0
        self._done_covered = 0.0
        self._done_hits = 0.0
        self._skipped_in_a_row = 0
        self.sent_tokens = 0  # tokens the last answer sent for verification (rows + drafts)
        #: `depth: "auto"`: the online depth choice (made on the first step, when K is known) and this
        #: step's depth (None: K)
        self.depth_choice: DepthChoice | None = None
        self.depth: int | None = None
        self._outlook_steps: dict[int, int] = {}  # per depth: branch steps its pre-draft would plan
        self._outlook_key: tuple[int, int] | None = None
        self._outlook_age = 0
        #: pre-draft or draft as `sync` does, round by round; `predrafted`: whether the round being verified
        #: now pre-drafts (the next step's figures are that mode's)
        self.switch = PreDraftSwitch()
        self.predrafted = True
        #: the plan and whether its branch steps pay, decided with the round (None: planned after the glue,
        #: where the options fix the plan or `fallback` is off)
        self.next_plan: tuple[PreDraftPlan, bool] | None = None
        self.select_row_s: float | None = None  # the candidate selection's seconds per logit row

    # ---- measurements -------------------------------------------------------------------------------
    def answered(self) -> None:
        """The answer went out: the verification starts now."""
        self.answered_at = time.monotonic()

    def measure_round(self, sent_at: float, ran_branches: bool) -> tuple[float, float]:
        """Verification time (previous answer -> this request's send) and lateness (send -> now), both 0
        before the first answer. Timing the verification from now instead would count the lateness in and
        grow the next plan by it; only rounds that ran branch steps tell their lateness."""
        now = time.monotonic()
        sent = sent_at if 0.0 < sent_at <= now else now
        verify_s = late_s = 0.0
        if self.answered_at is not None:
            verify_s, late_s = max(0.0, sent - self.answered_at), now - sent
            self.observe_round(verify_s, late_s, ran_branches)
        self.answered_at = None
        return verify_s, late_s

    def observe_round(self, verify_s: float, late_s: float, ran_branches: bool) -> None:
        """A round's verification time and lateness, however measured (the replay's virtual clock feeds
        them here, projection/replay.py)."""
        self.verify_s = smooth(self.verify_s, verify_s)
        self._round_late_s = late_s
        if ran_branches:
            self.late_s = smooth(self.late_s, late_s)

    def record_forward(self, rows: int, seconds: float, logits: int | None = None, parents: int = 0) -> None:
        """A draft forward that fed `rows` tokens and computed `logits` logit rows (default: one per token);
        `parents` > 0: a pre-draft branch step, its `rows` one-token rows forked from that many requests."""
        if parents > 0:
            self.branch_costs.append((rows, parents, seconds))
        else:
            self.costs.append((rows, rows if logits is None else logits, seconds))

    def cost_model(self) -> StepCostModel | None:
        """The requests' own forwards (glue, jit drafts, top-ups) fitted; None before three are measured."""
        if len(self.costs) < 3:
            return None
        samples = tuple(self.costs)
        if samples != self._cost_fit[0]:
            self._cost_fit = (samples, StepCostModel.fit_forwards(samples))
        return self._cost_fit[1]

    def branch_step_s(self, cost: StepCostModel, parents: int) -> Callable[[int], float] | None:
        """Seconds of a branch step of `rows` rows forked from `parents` requests, as a function of `rows`:
        each request's prefix read once, like one row of its own (`cost`), and each further branch row what
        the measured branch steps add beyond that (fitted over their further rows, at least proportional,
        like `StepCostModel.fit_forwards`); None before three branch steps are measured (`plan` then costs
        every row like a request's). A forked row shares its request's KV, so it costs far less than a
        request's own row (demo pair, batch 16: ~2.9 ms per own row, a 128-row branch step 160 ms); one fit
        over both kinds of forward would follow how many branch steps the planner's window happens to hold
        (docs/algorithm.md, "How much to pre-draft")."""
        if len(self.branch_costs) < 3:
            return None
        key = (cost, tuple(self.branch_costs))
        if key != self._branch_fit[0]:
            self._branch_fit = (key, StepCostModel.fit_forwards([(rows - p, 0, seconds - cost.forward_s(p, p))
                                                                 for rows, p, seconds in self.branch_costs]))
        extra = self._branch_fit[1]
        own = cost.forward_s(parents, parents)
        return lambda rows: own + extra.fixed_s + extra.per_row_s * max(0, rows - parents)

    def max_rows(self, cost: StepCostModel) -> int:
        """The most rows of a measured draft forward, branch steps included (`GROWTH`)."""
        return max([cost.max_rows or 0] + [rows for rows, _, _ in self.branch_costs])

    def observe_selection(self, rows: int, seconds: float) -> None:
        """A part of the pre-draft's candidate selection: `rows` logit rows in `seconds`."""
        if rows > 0:
            self.select_row_s = smooth(self.select_row_s, seconds / rows)

    def selection_part_rows(self, batch: int) -> int:
        """Logit rows per part of the candidate selection: what takes SELECT_SHARE of a draft forward of
        `batch` rows at the measured cost per row (all rows in one part until both are measured)."""
        cost = self.cost_model()
        if cost is None or not self.select_row_s:
            return 1 << 30
        return max(1, int(SELECT_SHARE * cost.forward_s(batch, batch) / self.select_row_s))

    def measure_rate(self, tokens: int, verify_s: float) -> None:
        """The tokens a step committed over its whole period (the previous answer, the verification and the
        round's lateness), kept as decayed sums: `rate` is their ratio, the long-run tokens per second that
        Dinkelbach's rule needs (call only for steps whose rows all finished a round: a step with new
        requests may follow an idle engine, whose gap is no verification). Not a moving average of each
        step's own tokens / (verification + answer): that follows the last few steps, mostly hits, and
        leaves the lateness out, so a jit draft or top-up at batch 1 looks not worth its forwards (replayed
        on the demo pair's T=0 trace: 27.6 tokens/s against 30.2 with this rate)."""
        if verify_s > 0:
            tokens_sum, seconds_sum = self._rate_sums
            self._rate_sums = (RATE_DECAY * tokens_sum + tokens,
                               RATE_DECAY * seconds_sum + verify_s + self.last_answer_s + self._round_late_s)
            self.rate = self._rate_sums[0] / self._rate_sums[1]

    def end_step(self, answer_s: float, sent_tokens: int, hits: int, looked_up: int, jit: bool,
                 all_hit: bool, ran_branches: bool = False, planned: int = 0, covered: int = 0,
                 committed: int | None = None, verify_s: float = 0.0) -> None:
        """What the answer just built took and sent: answer time (per kind), tokens to verify, hit rate;
        for `branch_hit_floor`, the looked-up rows whose round reached its plan (`planned`), those of them
        whose outcome lay within the planned fan-out (`covered`, hits included) and whether that round ran
        its branch steps (`ran_branches`); for the pre-draft switch, the tokens this step committed
        (`committed`, None where the step cannot be compared: new requests) over its verification, lateness
        and answer, credited to the mode of the round before it."""
        if committed is not None and verify_s > 0:
            self.switch.observe_step(self.predrafted, committed, verify_s + self._round_late_s + answer_s,
                                     looked_up)
        self.last_answer_s = answer_s
        self.sent_tokens = sent_tokens
        if looked_up:
            self.hit_rate = smooth(self.hit_rate, hits / looked_up)
        if planned:
            self._planned = BRANCH_HIT_DECAY * self._planned + planned
            self._covered = BRANCH_HIT_DECAY * self._covered + covered
        if ran_branches and covered:
            self._done_covered = BRANCH_HIT_DECAY * self._done_covered + covered
            self._done_hits = BRANCH_HIT_DECAY * self._done_hits + hits
        if jit:
            self.answer_s["miss"] = smooth(self.answer_s["miss"], answer_s)
        elif all_hit:
            self.answer_s["hit"] = smooth(self.answer_s["hit"], answer_s)

    @property
    def coverage(self) -> float | None:
        """Share of planned rounds' outcomes within their planned fan-out, by Laplace's rule (one covered and
        one not added to the decayed counts; None before any)."""
        return (self._covered + 1.0) / (self._planned + 2.0) if self._planned else None

    @property
    def completion(self) -> float:
        """Share of covered outcomes that hit where the branch steps ran (their branch existed at the
        lookup: not cut short before it was forked, not dropped for lack of KV blocks); one hit is added to
        the decayed counts, so it starts at 1."""
        return (self._done_hits + 1.0) / (self._done_covered + 1.0)

    def branch_hit_floor(self) -> float | None:
        """The hit rate the branch steps would yield, as measured: `coverage` x `completion` (None before
        any planned round was looked up). Coverage counts every planned round, its branch steps run or
        skipped, so the floor does not hang on the few rounds that ran them: the hit rate of those rounds
        alone reads low after a few early misses (demo pair, batch 1, T=1: 1/7), after which the steps run
        only in probe rounds and later likely outcomes are never branched for. Where the branch steps run but
        their branches are missing at the lookup (batch 32 on a CPU core: 2 hits of 32 against a modelled
        0.95), completion carries it."""
        coverage = self.coverage
        return None if coverage is None else coverage * self.completion

    def miss_cost_s(self) -> float:
        """What a just-in-time miss adds to an answer (0 until both kinds of answer are measured)."""
        miss, hit = self.answer_s["miss"], self.answer_s["hit"]
        return max(0.0, miss - hit) if miss is not None and hit is not None else 0.0

    # ---- decisions ----------------------------------------------------------------------------------
    def plan(self, batch: int, k: int) -> PreDraftPlan:
        """Branches per request and steps per branch of the next pre-draft."""
        fixed = self.opts.get("fanout") or None
        if fixed:
            return PreDraftPlan(sum(fixed), k)
        if self.opts.get("fanout_budget"):
            return PreDraftPlan(int(self.opts["fanout_budget"]), k)
        cost = self.cost_model()
        if cost is None or self.verify_s is None:
            return PreDraftPlan(k + 1, k)  # one branch per depth until timings are known
        plan = plan_predraft(PLAN_SAFETY * self.verify_s, cost, batch, k, self.predictor.neural.alpha,
                             max_branches=int(self.opts.get("max_fanout_budget") or MAX_FANOUT_BUDGET), ranks=self.ranks,
                             max_rows=GROWTH * max(self.max_rows(cost), batch),
                             branch_step_s=self.branch_step_s(cost, batch))
        if plan.branches == 0:  # not even one branch per depth fits one step: the most likely outcomes only
            return PreDraftPlan(max(1, min(2, k + 1)), 1)
        return plan

    def predraft_next(self, batch: int, k: int) -> bool:
        """Whether the round just sent (`batch` requests, `k` drafts each) pre-drafts, or leaves its rows to
        be drafted as `sync` does after the verification: where the pre-draft cannot pay for its costs
        (`fallback.PreDraftSwitch`), or where its branch steps would not pay (`branches_pay_off`: a glue
        without them is pure overhead), in which case the plan is kept in `next_plan`. A plan the options
        fix (`fanout`, `fanout_budget`, `finish_predraft`) or `fallback: "off"` always pre-drafts. One log
        line per change of mode (probes of the other mode are not logged)."""
        self.next_plan = None
        if (self.opts.get("fallback", "auto") == "off" or self.opts.get("fanout") or self.opts.get("fanout_budget")
                or self.opts.get("finish_predraft")):
            self.predrafted = True  # (the pre-draft plans after its glue, and may skip its branch steps)
            return True
        cost = self.cost_model()
        sync_rate = None
        pre = self.switch.rates[True]
        if cost is not None and pre.steps > 0 and self.verify_s is not None:
            sync_s = cost.forward_s(2 * batch, batch) + (k - 1) * cost.forward_s(batch, batch)
            sync_rate = (pre.tokens / pre.steps) / (self.verify_s + sync_s)
        before = self.switch.predrafting
        self.predrafted = self.switch.decide(self.verify_s, self.switch.glue_s(batch), sync_rate, batch)
        if self.switch.predrafting != before:
            logger.info("Saguaro pre-drafting %s: %s", "resumed" if self.switch.predrafting else
                        "paused, drafting as mode sync does", self.switch.reason)
        if self.predrafted:  # a round whose branch steps would not pay has nothing to glue for either
            plan = self.plan(batch, k)
            if self.switch.probing:
                # a probe of pre-drafting runs it whole, its branch steps included whatever
                # `branches_pay_off` says: the hit floor, lateness and glue it would judge by are measured
                # only in rounds that pre-draft, so in the fallback they stay what they were when it began
                # (a sampled warm-up's coverage, a cold first glue), and a probe that skipped its branch
                # steps would measure a `sync` round plus a glue and never bring pre-drafting back
                self._skipped_in_a_row = 0
                self.next_plan = (plan, True)
            else:
                self.next_plan = (plan, self.branches_pay_off(plan, batch, k))
            self.predrafted = self.next_plan[1]
        return self.predrafted

    def predraft_expected(self) -> bool:
        """Whether the next round is expected to pre-draft (a round drafted as `sync` keeps its draft logits
        for the next glue only then): the switch expects it (`PreDraftSwitch.predraft_expected`) and the
        branch steps are not being skipped round after round (`branches_pay_off`: a round that skips them
        runs no glue either), short of the round that runs them anyway. The switch alone stays "pre-drafting"
        while every round skips its branch steps (sampled batches, whose outcomes the fan-out never covers),
        and logits kept there for a glue that never comes made each draft forward write fresh memory."""
        if not self.switch.predraft_expected():
            return False
        if self.switch.predraft_probe_next():  # a probe of pre-drafting runs its branch steps (predraft_next)
            return True
        return self._skipped_in_a_row == 0 or self._branch_probe_due(self._skipped_in_a_row + 1)

    def branches_pay_off(self, plan: PreDraftPlan, batch: int, k: int) -> bool:
        """`predictor.branches_pay_off` for a modelled plan, once lateness and step costs are measured. The
        hit rate is the measured one (`branch_hit_floor`) once any planned round was looked up, else the
        plan's modelled one: the model, built on prior acceptance and ranks, misjudges both ways (batch 32,
        T=0: modelled far above the 0.29 measured; a certain outcome, draft == target at T=0: modelled ~0.3
        where every covered outcome hits, which skipped the branch steps in 32 of 34 rounds). Every
        PROBE_EVERY-th round in a row that would skip runs them anyway, so the measurement follows the
        workload."""
        cost = self.cost_model()
        if plan.hit_rate is None or self.late_s is None or cost is None or self.verify_s is None:
            return True
        floor = self.branch_hit_floor()
        hit_rate = plan.hit_rate if floor is None else floor
        pays = branches_pay_off(hit_rate, batch, k, self.verify_s, self.late_s, cost, self.predictor.neural.alpha,
                                self.predictor.ngram_tokens.mean, self.opts.get("backup", "auto"))
        if pays:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        if self._branch_probe_due(self._skipped_in_a_row):
            self._skipped_in_a_row = 0
            return True
        return False

    @staticmethod
    def _branch_probe_due(skipped_in_a_row: int) -> bool:
        """Whether a round that would be the `skipped_in_a_row`-th in a row to skip its branch steps runs
        them anyway (so their measurement follows the workload)."""
        return skipped_in_a_row >= PROBE_EVERY

    def observe_rank(self, temperature: float, accepted: int, k: int, rank: int) -> None:
        """A looked-up neural round (k drafts, `accepted` of them accepted) whose bonus token ranked `rank`
        among the candidates of its depth (MAX_RANK or more: not among them): the pooled `ranks` (the
        plan's model) and the calibrated statistics of the request's temperature (the fan-out)."""
        self.ranks.observe(min(rank, MAX_RANK))
        bucket = temperature_bucket(temperature)
        stats = self.outcomes.get(bucket)
        if stats is None:  # (not `setdefault`: that built a discarded OutcomeStats per row, ~4 us each)
            stats = self.outcomes[bucket] = OutcomeStats()
        stats.observe(accepted, k, rank)

    def fanout_for(self, k: int, fast: bool, budget: int, temperature: float | None = None) -> list[int]:
        """Fan-out per depth 0..k of a round with k drafts (`fast`: they came from the n-gram backup). A
        neural round of a request at `temperature` spends the budget where its temperature's calibrated
        statistics expect the most hits per branch (`OutcomeStats.allocate`); n-gram rounds, whose ranks
        are not measured, and calls without a temperature keep the geometric shape."""
        fixed = (self.opts.get("miss_fanout") if fast else None) or self.opts.get("fanout")
        if fixed:  # a round with fewer than K drafts (n-gram) keeps the list's depths 0..k-1 and its last
            return list(fixed[:k]) + [fixed[-1]] if len(fixed) != k + 1 else list(fixed)
        stats = None if fast or temperature is None else self.outcomes.get(temperature_bucket(temperature))
        if stats is not None:
            return stats.allocate(budget, k, self.predictor.neural.alpha)
        return self.predictor.fanout(budget, k, fast_backup=fast)

    def needs_ngram_drafts(self) -> bool:
        """Whether misses may keep n-gram drafts this step (`draft_now` weighs them); with `backup: "jit"`
        or before any timing is measured every miss is drafted now, so no n-gram lookup is needed."""
        policy = self.opts.get("backup", "auto")
        return policy == "ngram" or (policy == "auto" and self.verify_s is not None and len(self.costs) >= 3)

    def draft_now(self, candidates: Sequence[DraftNow], base_tokens: float) -> list[int]:
        """The rows to draft on the critical path (`backup.choose_draft_now` at the measured rate)."""
        cost = self.cost_model()
        return choose_draft_now(candidates, base_tokens, self.verify_s, cost and cost.fixed_s,
                                cost and cost.per_row_s, self.opts.get("backup", "auto"), rate=self.rate,
                                per_logit_s=cost.per_logit_s if cost else 0.0)

    def depth_outlook(self, batch: int, k_max: int) -> dict[int, tuple[float, int]]:
        """Per depth d: the hit rate and the branch steps of the pre-draft a round at depth d would plan.
        The hit rate is the measured one for every depth: the plan's modelled rates (prior-based ranks)
        underrate deep plans badly where the cache hits nearly always (T=0: modelled 0.68 for a 5-deep plan,
        measured 1.00), and a wrong ranking of depths costs more than a flat one."""
        hit_rate = self.hit_rate or 0.0
        key = (batch, k_max)
        if self._outlook_key != key or self._outlook_age >= OUTLOOK_EVERY:  # k_max plans: not every step
            self._outlook_steps = {d: self.plan(batch, d).steps for d in range(1, k_max + 1)}
            self._outlook_key, self._outlook_age = key, 0
        self._outlook_age += 1
        return {d: (hit_rate, steps) for d, steps in self._outlook_steps.items()}

    def choose_depth(self, batch: int, k_max: int, verify_s: float) -> int | None:
        """`depth: "auto"`: record the last verification and choose this step's depth (None: fixed K); one
        log line when the chosen depth changes. Each depth is judged by the pre-draft a round at that depth
        would plan (`depth_outlook`), not by the last plan: that one was bounded by the depth then in use,
        which would keep a shallow depth shallow (deeper hits would all look like top-ups)."""
        if self.opts.get("depth", "fixed") != "auto" or batch == 0:
            return None
        if self.depth_choice is None:
            self.depth_choice = DepthChoice(k_max)
        if verify_s > 0 and self.sent_tokens:
            self.depth_choice.observe(self.sent_tokens, verify_s)
        before = self.depth_choice.depth
        self.depth = self.depth_choice.choose(batch, self.predictor.neural.alpha, self.cost_model(),
                                              self.depth_outlook(batch, k_max))
        if self.depth_choice.depth != before:
            verify = self.depth_choice.verify_cost()
            logger.info("Saguaro depth: %d drafts per row now (was %d; acceptance %.2f, cache hit rate %.2f, "
                        "verification %.1f ms + %.2f ms per token)", self.depth_choice.depth, before,
                        self.predictor.neural.alpha, self.hit_rate or 0.0, 1e3 * verify.fixed_s,
                        1e3 * verify.per_row_s)
        return self.depth
