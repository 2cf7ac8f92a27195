"""Speculative speculative decoding (`mode: async`): pre-draft likely outcomes while the target verifies.

One round, per request (docs/algorithm.md has the whole story):
1. `step` answers the proposer: each row's committed tokens imply an outcome (a accepted, bonus t); the
   speculation cache answers with the branch pre-drafted for it (hit: its runner sequence is adopted, so
   its KV is kept; a branch cut short may be topped up to K tokens) or a backup drafts (miss: `jit` or
   `ngram`); which misses and cut-short hits are drafted now is decided per row by the `RoundPlanner`
   (`round_planner.py`), which also holds every measurement and the pre-draft plan.
2. Right after the answer is sent, `advance` runs the pre-drafting for the drafts just sent, one forward at
   a time: the glue step (KV and bonus distributions of every depth), candidate selection, then the
   branches' steps. Between forwards the server looks for the next request; when it comes, the pre-draft
   is cut short (`step` closes it first): finished branches and partial ones go into the cache, where a hit
   on a partial branch is completed on the critical path. Nothing stale can be served: a branch is keyed by
   its round and the round ends when its outcome is looked up.

Exactness does not depend on any of this: every draft token is either chosen deterministically (verified
one-hot by vLLM) or sampled from the proposal q' whose probabilities are sent with it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import torch

from saguaro_vllm.drafter.backup import draft_now_candidates, ngram_drafts
from saguaro_vllm.drafter.branches import BranchRun
from saguaro_vllm.drafter.predraft import PreDrafter
from saguaro_vllm.drafter.round_planner import RoundPlanner
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.sampling import sample_proposals
from saguaro_vllm.drafter.scale_choice import ScaleChoice, temperature_bucket
from saguaro_vllm.drafter.spec_cache import SpeculationCache
from saguaro_vllm.drafter.sync_drafter import NO_ROOM, SyncDrafter, _ReqState
from saguaro_vllm.drafter.trace import rank_of
from saguaro_vllm.shared.proposal_buffers import SlotWriter
from saguaro_vllm.shared.transport import StepRequest, StepResponse

logger = logging.getLogger("saguaro_vllm.drafter")

# Row status codes of `StepResponse.row_status` (and NO_ROOM: no drafts, the KV cache had no room).
HIT, JIT, NGRAM, NEW, NONE = "hit", "jit", "ngram", "new", "none"


@dataclasses.dataclass
class _Sent:
    """What a request's last answer sent: the round the cache holds for it."""

    context_len: int
    drafts: list[int]
    fast: bool  # drafts from the n-gram backup (their own acceptance estimate and fan-out)
    round_id: int = 0
    #: the Saguaro sampling C these drafts were sampled with (sampled rows; None: greedy or n-gram)
    scale: float | None = None
    #: per depth, the best candidate tokens in order (x_{j+1} excluded): where the real bonus token
    #: ranks among them feeds the planner's `RankEstimate`
    ranked: list[list[int]] | None = None
    #: the fan-out per depth the pre-draft planned for this round, its branch steps run or skipped: whether
    #: the outcome lay within it feeds the planner's `coverage`
    fan: list[int] | None = None
    #: drafts the next round wants (a round of zero drafts: how many steps its branches draft)
    want: int = 0


@dataclasses.dataclass
class SSDStats:
    """Per-step figures sent with the answer (the proposer turns them into metrics)."""

    budget: int = 0  # branches per request planned for the pre-draft that this step cut short or found done
    plan_steps: int = 0
    predraft_s: float = 0.0  # time the drafter spent pre-drafting for this step's outcomes
    predraft_done: bool = False  # did that pre-draft finish before this step's request came?
    verify_s: float = 0.0  # time between the previous answer and this request (the target's verification)
    late_s: float = 0.0  # time this request waited for the pre-draft forward in flight
    skipped: bool = False  # the branch steps were skipped: their expected saving was below their lateness
    branches: int = 0  # branches cached for this step's lookups
    backup: str = ""  # jit | ngram | jit+ngram: what this step's misses got
    depth: int = 0  # drafts per row this step allowed (`depth: "auto"`; 0: fixed at K)
    alpha: float = 0.0  # acceptance estimate of neural drafts
    dropped: int = 0  # candidates of that pre-draft left out for lack of KV blocks
    topups: int = 0  # hits on branches cut short, completed on the critical path in this step
    cut_short: bool = False  # a pre-draft was still running when this step's request came, and was stopped
    sampled_drafts: int = 0  # sampled draft tokens sent in this step (greedy and n-gram drafts excluded)
    scaled_drafts: int = 0  # ... of them drafted in a round whose Saguaro sampling C was below 1
    scale_sum: float = 0.0  # sum of C over the sampled draft tokens (mean C = scale_sum / sampled_drafts)
    fork_copies: int = 0  # partial KV blocks copied when the pre-draft forked its branches
    branch_blocks: int = 0  # KV blocks reserved for branches' tokens past a block edge
    #: the round before this step pre-drafted (False: the planner's fallback left its rows to be drafted
    #: after the verification, as `sync` does)
    predrafted: bool = True


@dataclasses.dataclass
class _Answer:
    """One step's answer as it is built, per row of the request."""

    n: dataclasses.InitVar[int]
    drafts: list[list[int]] = dataclasses.field(init=False)
    probs: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)  # row -> q' of each sampled draft
    status: list[str] = dataclasses.field(init=False)
    depth: list[int] = dataclasses.field(init=False)  # the looked-up outcome's accepted count (-1: none)
    resync: list[str] = dataclasses.field(default_factory=list)
    want: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> drafts it may get (K, or fewer)
    misses: list[int] = dataclasses.field(default_factory=list)
    topups: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (row, drafts to add): hits cut short
    fast: set[int] = dataclasses.field(default_factory=set)  # misses answered by the n-gram backup (or nothing)
    sync_like: bool = False  # the round before did not pre-draft: every miss is drafted now, as `sync` does
    planned: int = 0  # looked-up rows whose round reached its plan (a fan-out) ...
    covered: int = 0  # ... and of them, those whose outcome lay within it (`RoundPlanner.coverage`)
    trace: dict[int, dict] = dataclasses.field(default_factory=dict)  # row -> its trace fields (tracing only)

    def __post_init__(self, n: int) -> None:
        self.drafts = [[] for _ in range(n)]
        self.status = [NONE] * n
        self.depth = [-1] * n


class SSDDrafter(PreDrafter, SyncDrafter):
    def __init__(self, runner: DraftModelRunner, vocab_size: int, options: dict, max_model_len: int | None = None):
        super().__init__(runner, vocab_size, keep_logits=True, max_model_len=max_model_len)
        self.opts = options
        self.cache = SpeculationCache(release=self._defer_release, release_many=self._defer_release_many)
        self._garbage: list[str] = []  # branch sequences to free once the answer is out
        self._garbage_rounds: list[list] = []  # and the branches of whole rounds (their ids read then)
        self._total_blocks = runner.num_free_blocks
        self.planner = RoundPlanner(options)  # measurements and decisions (no model work)
        self._sent: dict[str, _Sent] = {}
        self._work: Iterator[None] | None = None
        #: the round just answered (its requests, the most drafts a row wants), until the pre-draft for it is
        #: decided, after the answer is out (`_start_predraft`)
        self._pending: tuple[list[str], int] | None = None
        self._run: BranchRun | None = None  # the pre-draft's branch run (its step index picks Saguaro's F)
        self._predraft = SSDStats()
        self._fanout: list[int] = []  # the neural allocation in use (Saguaro sampling's F per depth)
        self.scale_choice = ScaleChoice() if options.get("sampling_scale") == "auto" else None
        self._best_scale: dict[int, float] = {}  # per temperature bucket: the best C last logged

    @property
    def predictor(self):
        """The planner's outcome predictor (acceptance and n-gram estimates the lookups feed)."""
        return self.planner.predictor

    # ---- bookkeeping ------------------------------------------------------------------------------
    def _release(self, seq_id: str) -> None:
        if self.runner.has_request(seq_id):
            self.runner.free_request(seq_id)

    def _defer_release(self, seq_id: str) -> None:
        """Branches that lost their round are freed after the answer is sent (off the critical path)."""
        self._garbage.append(seq_id)

    def _defer_release_many(self, branches: list) -> None:
        self._garbage_rounds.append(branches)

    def _flush_garbage(self) -> None:
        garbage, self._garbage = self._garbage, []
        if self._garbage_rounds:
            rounds, self._garbage_rounds = self._garbage_rounds, []
            garbage += [b.seq_id for branches in rounds for b in branches]
        self.runner.free_many(self.runner.held(list(dict.fromkeys(garbage))))  # in order, each once

    def free(self, req_id: str) -> None:
        self.cache.drop(req_id)
        self._sent.pop(req_id, None)
        super().free(req_id)

    def _evict(self, req_id: str) -> None:
        """A request's KV goes: its round goes with it (a later step finds no round: a new request)."""
        self.cache.drop(req_id)
        self._sent.pop(req_id, None)
        super()._evict(req_id)

    def _make_room(self, blocks: int, protect: set[str]) -> bool:
        """Pre-drafts go first, so that branches never starve the requests' own KV: the branches waiting
        to be freed, then the cached rounds of requests absent from this step; only then request KV."""
        self._flush_garbage()
        for rid in [r for r in self._sent if r not in protect]:
            if self.runner.num_free_blocks >= blocks:
                break
            self.cache.drop(rid)  # its branches go to the garbage (the request's own KV stays)
            self._flush_garbage()
        return self.runner.num_free_blocks >= blocks or super()._make_room(blocks, protect)

    @property
    def busy(self) -> bool:
        """Pre-drafting (or deferred clean-up) is pending: call `advance` while no request is waiting."""
        return (self._work is not None or self._pending is not None or bool(self._garbage)
                or bool(self._garbage_rounds))

    def answered(self) -> None:
        """The answer of the last `step` went out: the verification starts now."""
        self.planner.answered()
        if self.trace is not None:
            self.trace.answered()
        self._start_predraft()

    def _start_predraft(self) -> None:
        """Decide the answered round's pre-draft (`RoundPlanner.predraft_next`: plan and whether it pays, off
        the critical path since the answer is out) and queue it, or leave its rows to `sync` drafting."""
        if self._pending is not None:
            roots, k = self._pending
            self._pending = None
            if self.planner.predraft_next(len(roots), k):
                self._work = self._predraft_rounds(roots)

    def advance(self) -> None:
        """One forward of the pre-draft, or the deferred clean-up when no pre-draft is pending."""
        self._start_predraft()  # (where `answered` was not called)
        if self._work is None:
            self._flush_garbage()
            return
        try:
            next(self._work)
        except StopIteration:
            self._work = None
        except Exception:
            self._work = None
            raise

    def _stop_predraft(self) -> None:
        if self._work is not None:
            self._work.close()  # the generator's `finally` caches what was drafted so far
            self._work = None

    def _forward(self, chunks, num_logits=1) -> torch.Tensor:
        """A timed forward: the planner's cost model learns from every forward the drafter runs."""
        t0 = time.perf_counter()
        logits = self._model_forward(chunks, num_logits=num_logits)
        self.runner.synchronize()  # on CUDA the clock must see the forward, not its launch
        seconds, tokens = time.perf_counter() - t0, sum(len(c[1]) for c in chunks)
        self.planner.record_forward(tokens, seconds, logits=logits.shape[0])
        if self.trace is not None:
            self.trace.forward(tokens, logits.shape[0], seconds)
        return logits

    # ---- the answer ---------------------------------------------------------------------------------
    def _draft_step(self, req: StepRequest, writer: SlotWriter) -> StepResponse:
        """The answer (`SyncDrafter.step` holds `writer`, the proposal slot of its sampled rows' q')."""
        t0 = time.perf_counter()
        stats, ran_branches = self._close_round(req)
        if self.trace is not None:
            self.trace.begin_step(req.step, len(req.rows), verify_s=stats.verify_s,
                                  late_s=stats.late_s, depth=stats.depth, cut_short=stats.cut_short,
                                  ran_branches=ran_branches, sent_at=req.sent_at,
                                  predrafted=self.planner.predrafted)
        self._begin_step(req)
        ans = _Answer(len(req.rows))
        ans.sync_like = not self.planner.predrafted
        stats.predrafted = self.planner.predrafted
        for i, row in enumerate(req.rows):
            self._answer_row(i, row, ans)
        committed = None
        if stats.verify_s > 0 and NEW not in ans.status and req.rows:
            committed = sum(len(r.new_tokens) for r, x in zip(req.rows, ans.status) if x in (HIT, JIT))
            self.planner.measure_rate(committed, stats.verify_s)
        jit_rows = self._back_up(req, ans, stats, writer)
        for i in self._end_step(ans.drafts):
            ans.status[i] = NO_ROOM
        probs_slot, probs_rows = self._publish_probs(req, ans.drafts, ans.probs, writer)
        roots, k = self._send_rounds(req, ans, stats, writer)
        stats.alpha = self.predictor.neural.alpha
        looked_up = [x for x in ans.status if x in (HIT, JIT, NGRAM)]
        answer_s = time.perf_counter() - t0
        self.planner.end_step(answer_s, sum(1 + len(d) for d in ans.drafts), looked_up.count(HIT),
                              len(looked_up), jit=bool(jit_rows), all_hit=not jit_rows and HIT in ans.status,
                              ran_branches=ran_branches, planned=ans.planned, covered=ans.covered,
                              committed=committed, verify_s=stats.verify_s)
        if self.trace is not None:
            self._trace_answer(req, ans, answer_s)
        self._pending = (roots, k) if roots else None  # decided once the answer is out (after end_step)
        resp = StepResponse(req.step, ans.drafts, {}, time.perf_counter() - t0, ans.resync,
                            live_requests=len(self.reqs), free_blocks=self.runner.num_free_blocks,
                            row_status=ans.status, row_depth=ans.depth, ssd=dataclasses.asdict(stats),
                            probs_slot=probs_slot, probs_rows=probs_rows, probs_capped=self.probs_capped)
        self._predraft = SSDStats()
        return resp

    def _close_round(self, req: StepRequest) -> tuple[SSDStats, bool]:
        """The request ends the round: measure it (verification, lateness), choose this step's depth, and
        stop the pre-draft (finishing it first with `finish_predraft`). Returns the round's figures and
        whether its branch steps ran."""
        self._start_predraft()  # (a round neither answered nor advanced still decides its mode)
        stats = self._predraft
        stats.predraft_done = self._work is None
        ran_branches = bool(stats.budget) and not stats.skipped
        stats.verify_s, stats.late_s = self.planner.measure_round(req.sent_at, ran_branches=ran_branches)
        stats.depth = self.planner.choose_depth(len(req.rows), max((r.num_drafts for r in req.rows), default=0),
                                                stats.verify_s) or 0
        if self.opts.get("finish_predraft"):
            while self._work is not None:
                self.advance()
        stats.cut_short = self._work is not None
        self._stop_predraft()
        stats.branches = len(self.cache)
        return stats, ran_branches

    def _answer_row(self, i: int, row, ans: _Answer) -> None:
        """Row i's lookup: a hit takes its branch (KV adopted; a branch cut short becomes a top-up
        candidate), a miss becomes a backup candidate; the outcome feeds the predictor, ranks and C choice."""
        st = self.reqs.get(row.req_id)
        sent = self._sent.pop(row.req_id, None)
        branch = None
        if st is not None and sent is not None:
            had_branches = self.cache.has_entries(row.req_id)
            outcome, branch = self.cache.lookup(row.req_id, row.start, row.new_tokens)
            ans.status[i] = JIT  # a miss until proven otherwise; the backup kind is set later
            if outcome is not None:
                ans.depth[i] = outcome.accepted
                self._observe(st, sent, outcome, missed=branch is None, had_branches=had_branches, ans=ans)
            if self.trace is not None:
                ranked = self.trace.ranked.pop(row.req_id, None)
                ans.trace[i] = {"a": outcome.accepted if outcome else -1, "t": outcome.bonus if outcome else -1,
                                "k": len(sent.drafts), "fast": sent.fast, "scale": sent.scale,
                                "rank": rank_of(ranked, outcome.accepted, outcome.bonus) if outcome else -1}
        else:
            self.cache.drop(row.req_id)
            ans.status[i] = NEW
        if branch is not None:  # (lookup matched the position: row.start == len(st.context))
            ans.status[i] = HIT
            self.runner.adopt(branch.seq_id, row.req_id)
            st.context.extend(row.new_tokens)
            toks = list(branch.tokens)
            ans.want[i] = self._draft_limit(row, st)
            if ans.want[i] <= 0:  # at max_model_len, or a context the cache cannot hold (its KV is gone)
                self._evict(row.req_id)
                return
            keep = min(len(toks), ans.want[i])
            ans.drafts[i] = toks[:keep]
            st.drafted = toks[: max(keep - 1, 0)]
            st.draft_logits = branch.logit_refs[:keep]
            if self.runner.num_computed(row.req_id) > len(st.context) + len(st.drafted):
                self.runner.truncate(row.req_id, len(st.context) + len(st.drafted))
            if keep and not st.sampling.greedy:
                rows = branch.prob_rows
                if rows:
                    ans.probs[i] = list(rows[:keep])
            if keep < ans.want[i]:
                ans.topups.append((i, ans.want[i] - keep))
            return
        st = self._update(row)
        if st is None:
            ans.resync.append(row.req_id)
            ans.status[i] = NONE
            return
        if row.num_drafts <= 0 or not st.context:
            ans.status[i] = NONE
            return
        ans.want[i] = self._draft_limit(row, st)
        if ans.want[i] <= 0:
            ans.status[i] = NONE
            return
        ans.misses.append(i)

    def _observe(self, st: _ReqState, sent: _Sent, outcome, missed: bool, had_branches: bool,
                 ans: _Answer) -> None:
        """A verified outcome of the drafts `sent`: acceptance (neural or n-gram), the bonus token's rank
        among the candidates, whether it lay within the planned fan-out, and the C the drafts were sampled
        with."""
        if sent.drafts:  # a round of zero drafts says nothing of acceptance, only of the next token's rank
            self.predictor.observe(outcome.accepted, len(sent.drafts), fast_backup=sent.fast)
        if sent.fast:
            self.predictor.ngram_tokens.observe(outcome.accepted + 1)
            self.predictor.ngram_matched.observe(outcome.accepted + 1)
        if sent.ranked is not None:
            ranked = sent.ranked[outcome.accepted]
            rank = ranked.index(outcome.bonus) if outcome.bonus in ranked else len(ranked)
            if not sent.fast:
                self.planner.observe_rank(st.sampling.temperature, outcome.accepted, len(sent.drafts), rank)
            if sent.fan is not None:  # (`ranked` holds at least the fan-out's width per depth)
                ans.planned += 1
                ans.covered += not missed or rank < sent.fan[outcome.accepted]
        if self.scale_choice is not None and sent.scale is not None and had_branches:
            self.scale_choice.observe(st.sampling.temperature, sent.scale, outcome.accepted + 1, missed=missed)

    def _back_up(self, req: StepRequest, ans: _Answer, stats: SSDStats, writer: SlotWriter) -> list[int]:
        """Misses and cut-short hits: those worth it are drafted now (jit, top-ups; `_choose_draft_now`),
        the other misses get their n-gram drafts or none. Returns the jit rows."""
        if ans.sync_like:  # no pre-draft ran for this step: every row is drafted now, as `sync` does
            ngram, now = {}, set(ans.misses)
        else:
            ngram = ({i: ngram_drafts(self.reqs[req.rows[i].req_id].context, ans.want[i]) for i in ans.misses}
                     if self.planner.needs_ngram_drafts() else {})
            now = set(self._choose_draft_now(req, ans.status, ans.drafts, ans.misses, ans.topups, ngram, ans.want))
        if self.trace is not None:
            self._trace_backups(req, ans, ngram)
        jit_rows = [i for i in ans.misses if i in now]
        topups = [(i, more) for i, more in ans.topups if i in now]
        ans.fast = set(ans.misses) - now
        stats.backup = "+".join(k for k, rows in ((JIT, jit_rows), (NGRAM, ans.fast)) if rows)
        for i in ans.fast:
            st = self.reqs[req.rows[i].req_id]
            ans.drafts[i] = ngram.get(i, [])
            if not ans.drafts[i]:  # no earlier occurrence: this verification yields the bonus token alone
                self.predictor.ngram_tokens.observe(1)
            st.drafted, st.draft_logits = [], []
            ans.status[i] = NGRAM if ans.status[i] == JIT else ans.status[i]
        stats.topups = len(topups)
        # the draft logits feed the next pre-draft's glue: not kept where no pre-draft is expected
        self.keep_logits = not ans.sync_like or self.planner.predraft_expected()
        self._draft_now(req, ans, topups, jit_rows, writer)
        return jit_rows

    def _trace_backups(self, req: StepRequest, ans: _Answer, ngram: dict[int, list[int]]) -> None:
        """Per miss: the context a jit draft would feed and the n-gram drafts it could keep (the replay
        decides backups itself); per cut-short hit: the top-up it could get."""
        for i in ans.misses:
            rid = req.rows[i].req_id
            st = self.reqs[rid]
            computed = self.runner.num_computed(rid) if self.runner.has_request(rid) else 0
            ng = ngram[i] if i in ngram else ngram_drafts(st.context, ans.want[i])
            ans.trace.setdefault(i, {}).update(feed=max(1, len(st.context) - computed), ng=len(ng))
        for i, more in ans.topups:
            ans.trace.setdefault(i, {})["more"] = more

    def _trace_answer(self, req: StepRequest, ans: _Answer, answer_s: float) -> None:
        """The step's rows (status, outcome, what was served) and its answer time."""
        rec = self.trace.rec
        for i, row in enumerate(req.rows):
            st = self.reqs.get(row.req_id)
            rec["rows"].append({"id": row.req_id, "st": ans.status[i], "new": len(row.new_tokens), "nd": row.num_drafts,
                                "temp": st.sampling.temperature if st is not None else 0.0,
                                "want": ans.want.get(i, 0), "served": len(ans.drafts[i]), **ans.trace.get(i, {})})
        rec["answer_s"] = answer_s
        rec["hit_rate"], rec["rate"] = self.planner.hit_rate, self.planner.rate

    def _send_rounds(self, req: StepRequest, ans: _Answer, stats: SSDStats, writer: SlotWriter
                     ) -> tuple[list[str], int]:
        """Every row with drafts starts a round (what the next lookup is against; returned with the most
        drafts a row wants, for the pre-draft `step` queues unless the planner falls back); sampled rows
        note their C, and with `sampling_scale: "auto"` choose the next one.

        A miss left without any drafts (a new request, or no n-gram match, where drafting now did not pay)
        starts a round of zero drafts: its outcome is its next token alone, so the pre-draft feeds its
        context (off the critical path) and branches on that token's candidates, and the next step is a
        hit like any other. Without it such a row is a miss again next step, weighed again by the backup
        rule, and can stay undrafted for its whole life (measured at vocabulary 128k, T=1, 1000 requests of
        5 tokens: 202 of 2395 rows drafted over 64 steps, speculation reported stalled)."""
        roots, k = [], 0
        for i, row in enumerate(req.rows):
            if not ans.drafts[i] and i not in ans.fast:
                continue
            k = max(k, ans.want[i])
            st = self.reqs[row.req_id]
            fast = i in ans.fast and bool(ans.drafts[i])
            sent = _Sent(len(st.context), list(ans.drafts[i]), fast, want=ans.want[i])
            # sampled drafts (q' copied at publishing, or written in place): the C they were drafted with, then
            # the next round's
            if (i in ans.probs or i in writer.written) and not fast:
                sent.scale = self._scale_of(st)
                stats.sampled_drafts += len(ans.drafts[i])
                stats.scaled_drafts += len(ans.drafts[i]) if sent.scale < 1.0 else 0
                stats.scale_sum += sent.scale * len(ans.drafts[i])
                if self.scale_choice is not None:
                    st.scale = self._next_scale(st)
            sent.round_id = self.cache.start_round(row.req_id, sent.context_len, sent.drafts)
            self._sent[row.req_id] = sent
            roots.append(row.req_id)
        return roots, k

    def _draft_limit(self, row, st) -> int:
        """K (fewer near the limits, see SyncDrafter), or this step's depth with `depth: "auto"`."""
        limit = super()._draft_limit(row, st)
        return min(limit, self.planner.depth) if self.planner.depth is not None else limit

    def _choose_draft_now(self, req: StepRequest, status, drafts, misses, topups, ngram, want) -> list[int]:
        """The rows drafted on the critical path this step (`backup.choose_draft_now`): each miss gains
        E(alpha, K) over its n-gram drafts (their measured tokens per verification, or the bonus token alone
        where there are none), each hit cut short E(alpha, K) over its s tokens."""
        if not misses and not topups:
            return []
        missed = {}
        for i in misses:
            rid = req.rows[i].req_id
            computed = self.runner.num_computed(rid) if self.runner.has_request(rid) else 0
            missed[i] = (max(1, len(self.reqs[rid].context) - computed), want[i], bool(ngram.get(i)))
        hits = {i: len(d) for i, (x, d) in enumerate(zip(status, drafts, strict=True)) if x == HIT}
        candidates, base = draft_now_candidates(len(req.rows), missed, hits, topups,
                                                {i: len(drafts[i]) for i, _ in topups},
                                                self.predictor.neural.alpha, self.predictor.ngram_matched.mean)
        return self.planner.draft_now(candidates, base)

    def _draft_now(self, req: StepRequest, ans: _Answer, topups, jit_rows, writer: SlotWriter) -> None:
        """Draft on the critical path: `ans.want[row]` (K) tokens for jit misses, the missing tail of hits cut
        short. Misses that find no room let go of their KV (hits keep theirs: they have drafts). Sampled rows'
        q' go straight into `writer`'s slot where they all fit (`_in_place`)."""
        tight = self.runner.num_free_blocks < self._total_blocks // 4
        if (jit_rows or topups) and (self._garbage or self._garbage_rounds) and tight:
            self._flush_garbage()  # the KV cache is tight: the deferred branches' blocks are needed now
        jobs: dict[int, int] = {}  # row -> drafts still wanted
        chunks = []
        for i in jit_rows:
            chunks.append(self._context_chunk(req.rows[i].req_id, self.reqs[req.rows[i].req_id]))
            jobs[i] = ans.want[i]
        for i, more in topups:  # fed: the branch's last token (its KV is not written yet)
            rid = req.rows[i].req_id
            chunks.append((rid, [ans.drafts[i][-1]], self.runner.num_computed(rid)))
            jobs[i] = more
        order = list(jit_rows) + [i for i, _ in topups]
        slot = writer if self._in_place(req, ans, order, writer) else None
        self._draft_chains(req, order, chunks, jobs, ans.drafts, ans.probs, evictable=set(jit_rows), slot=slot)

    def _in_place(self, req: StepRequest, ans: _Answer, order: list[int], writer: SlotWriter) -> bool:
        """Whether the q' drafted now can go straight into `writer`'s slot, one batched write per forward, as
        `sync` writes them: each forward's q' is then freed at once instead of held until the answer (held,
        every forward's sampler wrote fresh memory: its cumsum took 1.4x `sync`'s at batch 16, vocabulary
        128k). Every sampled row, the hits whose branch q' is copied at publishing included, must fit beside a
        one-hot row per other drafted row (`fit_rows` would keep them all); their slot rows are taken in
        answer order, the order the target's sampler reads without copying."""
        if not writer.available or not order:
            return False
        drafted_now = [i for i in order if not self.reqs[req.rows[i].req_id].sampling.greedy]
        if not drafted_now:
            return False
        sampled = set(drafted_now) | {i for i, p in ans.probs.items() if p and ans.drafts[i]}
        others = sum(1 for i, d in enumerate(ans.drafts) if (d or i in order) and i not in sampled)
        if len(sampled) > writer.ring.rows - others:
            return False
        for i in sorted(sampled):
            writer.row_of(i)
        return True

    def _sample(self, st: _ReqState, logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts for rows of one request at one depth (e.g. its branches' next tokens)."""
        f, c = self._scaling(st, depth)
        n = logits.shape[0]
        return sample_proposals(logits, [st.sampling] * n, [st.generator] * n, f, c)

    def _scaling(self, st: _ReqState, depth: int) -> tuple[int, float]:
        """Saguaro sampling: the top-F probabilities of the request's proposal scaled by C, F = the fan-out
        at the draft's depth (+1 with `sampling_scale_tokens: "fanout+1"`); (0, 1.0) when C is 1."""
        c = self._scale_of(st)
        f = self._fanout[depth] if c < 1.0 and depth < len(self._fanout) else 0
        if f and self.opts.get("sampling_scale_tokens") == "fanout+1":
            f += 1
        return f, c

    def _scale_of(self, st: _ReqState) -> float:
        """The C this request drafts with now: the configured one, or its round's arm with `"auto"`."""
        if self.scale_choice is None:
            return float(self.opts.get("sampling_scale", 1.0))
        if st.scale is None:
            st.scale = self._next_scale(st)
        return st.scale

    def _next_scale(self, st: _ReqState) -> float:
        """The online choice's C for the request's next round (logs a change of the best C once)."""
        verify_s = self.planner.verify_s or 1.0
        miss_s = self.planner.miss_cost_s()
        temperature = st.sampling.temperature
        if self.scale_choice.explored(temperature):
            best = self.scale_choice.best(temperature, verify_s, miss_s)
            bucket = temperature_bucket(temperature)
            if self._best_scale.get(bucket) != best:
                self._best_scale[bucket] = best
                rates = ", ".join(f"C={c:g}: {s.tokens_per_s(verify_s, miss_s):.1f}" for c, s
                                  in self.scale_choice.stats(temperature).items())
                logger.info("Saguaro sampling: C=%g now best at temperature %.1f (estimated tokens/s %s; "
                            "verification %.0f ms, a miss adds %.0f ms)", best, temperature, rates,
                            1e3 * verify_s, 1e3 * miss_s)
        return self.scale_choice.choose(temperature, verify_s, miss_s)

