"""Synchronous drafting (`mode: sync`): after each verification outcome, draft K tokens per request.

Per request the drafter keeps the committed context (append-only: vLLM only ever appends accepted and
bonus tokens) and the draft tokens whose KV it wrote beyond it. An outcome needs no explicit (accepted,
bonus) pair: the new committed tokens are compared with the previous drafts, the KV of the matching prefix
is kept, the rest is rolled back, and only the tokens the draft has not seen are fed. This also recovers
from any gap (skipped steps, trimmed drafts, preemption) because it only relies on the committed context.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from saguaro_vllm.drafter.kv_cache import OutOfBlocksError
from saguaro_vllm.drafter.room import NoRoomLog
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.sampling import request_generator, sample_proposals
from saguaro_vllm.drafter.spec_cache import derive_outcome
from saguaro_vllm.drafter.trace import TraceRecorder
from saguaro_vllm.shared.proposal_buffers import ProposalRing, SlotWriter, fit_rows
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest, StepResponse

logger = logging.getLogger("saguaro_vllm.drafter")

# Row status codes of `StepResponse.row_status` in `mode: sync` (`mode: async` adds its own, ssd_drafter.py).
DRAFTED, NONE, NO_ROOM = "drafted", "none", "noroom"


@dataclasses.dataclass
class _ReqState:
    sampling: SamplingSpec
    generator: torch.Generator | None
    context: list[int] = dataclasses.field(default_factory=list)
    drafted: list[int] = dataclasses.field(default_factory=list)  # drafts with KV after the context
    #: with `keep_logits`: where the draft logits each draft of the last step was chosen from are ([vocab]
    #: rows as (tensor, row) pairs: a view per row costs host time, and only the pre-draft reads them); row j
    #: is the depth-j bonus distribution that SSD's outcome prediction needs (drafter/branches.py).
    draft_logits: list[tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)
    #: `mode: async` with `sampling_scale: "auto"`: the Saguaro sampling C this request drafts with now
    scale: float | None = None


class SyncDrafter:
    def __init__(self, runner: DraftModelRunner, vocab_size: int, keep_logits: bool = False,
                 max_model_len: int | None = None, probs_ring: ProposalRing | None = None):
        """`max_model_len`: contexts that reach it get no drafts (fewer near it); None: no limit.
        `probs_ring`: where sampled rows' proposal probabilities go (shared with the proposer,
        proposal_buffers.py); without one, or with every slot held, sampled rows get no drafts (exact)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.keep_logits = keep_logits
        self.probs_ring = probs_ring
        self.num_no_probs_slot = 0
        self.probs_capped = 0  # sampled rows of the last answer left without drafts by the ring's rows
        self.max_model_len = max_model_len
        self.reqs: dict[str, _ReqState] = {}
        #: rows (per step) that got no drafts, or fewer, because the KV cache had no room for them
        self.num_out_of_blocks = 0
        #: tokens the whole KV cache holds: a longer context can never be drafted for
        self.capacity_tokens = runner.kv_cache.cfg.num_blocks * runner.block_size
        self.no_room_log = NoRoomLog(logger)
        self._last_used: dict[str, int] = {}  # request -> the last step that had it as a row (for eviction)
        self._step = 0
        self._no_room: set[int] = set()  # rows of the current step refused for lack of room
        #: the opt-in replay trace (`saguaro.trace_dir`, set by the server; drafter/trace.py); None: off
        self.trace: TraceRecorder | None = None
        self._trace_sent: dict[str, list[int]] = {}  # `sync` with a trace: each request's last drafts

    # ---- the server loop's hooks (SSD does work between requests; sync drafting does none) ----------
    busy = False

    def answered(self) -> None:
        """The answer of the last `step` went out."""
        if self.trace is not None:
            self.trace.answered()

    def advance(self) -> None:
        """Work between requests: none in `mode: sync`."""

    # ---- request bookkeeping --------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        self._last_used.pop(req_id, None)
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)

    # ---- memory pressure --------------------------------------------------------------------------------
    def _draft_limit(self, row: RowUpdate, st: _ReqState) -> int:
        """Drafts the row may get: K; fewer near `max_model_len`; none for a context that the whole KV cache
        cannot hold (drafting k tokens writes KV for context + k - 1), which is warned about once."""
        n = len(st.context)
        k = row.num_drafts if self.max_model_len is None else min(row.num_drafts, self.max_model_len - n)
        if k > 0 and n + k - 1 > self.capacity_tokens:
            k = self.capacity_tokens - n + 1
            if k <= 0:
                self.no_room_log.oversize(row.req_id, n, self.capacity_tokens)
                self._no_room.add(self._row_index[row.req_id])
        if k <= 0 and row.num_drafts > 0:
            self._evict(row.req_id)  # contexts only grow: its KV will never be used, the others get it
        return max(k, 0)

    def _evict(self, req_id: str) -> None:
        """Let go of the request's KV (its context stays known: a later step prefills it again)."""
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)
        st = self.reqs.get(req_id)
        if st is not None:
            st.drafted, st.draft_logits = [], []

    def _make_room(self, blocks: int, protect: set[str]) -> bool:
        """Free blocks until `blocks` are free, without touching the requests in `protect` (this step's
        rows): the KV of requests absent from this step (preempted or waiting) goes first, least recently
        used first. True if there is room now."""
        idle = sorted((self._last_used.get(rid, 0), rid) for rid in self.reqs
                      if rid not in protect and self.runner.has_request(rid))
        for _, rid in idle:
            if self.runner.num_free_blocks >= blocks:
                break
            self._evict(rid)
        return self.runner.num_free_blocks >= blocks

    def _reserve(self, req_id: str, num_tokens: int, protect: set[str]) -> bool:
        """`runner.reserve`, making room first if needed; False (nothing changed) if there is none."""
        for attempt in range(2):
            try:
                self.runner.reserve(req_id, num_tokens)
                return True
            except OutOfBlocksError as err:
                if attempt or not self._make_room(err.needed, protect):
                    return False
        return False

    def _update(self, row: RowUpdate) -> _ReqState | None:
        """Append the row's new committed tokens; None if they do not continue the context we hold."""
        st = self.reqs.get(row.req_id)
        if row.start != (len(st.context) if st else 0):
            self.free(row.req_id)
            return None
        if st is None:
            spec = row.sampling or SamplingSpec()
            gen = None if spec.greedy else request_generator(spec.seed)
            st = self.reqs[row.req_id] = _ReqState(spec, gen)
        old_len = len(st.context)
        st.context.extend(row.new_tokens)
        matched = 0
        for a, b in zip(st.drafted, row.new_tokens):
            if a != b:
                break
            matched += 1
        if self.runner.has_request(row.req_id):
            valid = min(self.runner.num_computed(row.req_id), old_len + matched)
            self.runner.truncate(row.req_id, valid)
        st.drafted = []
        st.draft_logits = []
        return st

    # ---- one step ---------------------------------------------------------------------------------
    def _begin_step(self, req: StepRequest) -> None:
        """Bookkeeping every step starts with: finished requests freed, this step's rows noted."""
        for rid in req.finished:
            self.free(rid)
        self._step += 1
        self._no_room = set()
        self._row_index = {row.req_id: i for i, row in enumerate(req.rows)}
        for row in req.rows:
            self._last_used[row.req_id] = self._step

    def _end_step(self, drafts: list[list[int]]) -> list[int]:
        """The rows refused for lack of room that got no drafts at all (counted, and warned about at most
        once per `NoRoomLog.interval_s`)."""
        rows = sorted(i for i in self._no_room if not drafts[i])
        self.num_out_of_blocks += len(self._no_room)
        self.no_room_log.note(len(rows), self.runner.num_free_blocks, self.runner.kv_cache.cfg.num_blocks)
        return rows

    def step(self, req: StepRequest) -> StepResponse:
        writer = SlotWriter(self.probs_ring, req.step)
        try:
            return self._draft_step(req, writer)
        except BaseException:
            writer.abandon()  # a failed step publishes nothing: its slot goes back to the ring
            raise

    def _draft_step(self, req: StepRequest, writer: SlotWriter) -> StepResponse:
        t0 = time.perf_counter()
        self._begin_step(req)
        if self.trace is not None:
            self._trace_lookups(req)
        drafts: list[list[int]] = [[] for _ in req.rows]
        jobs: dict[int, int] = {}  # row -> drafts it gets (K, fewer near the limits)
        order: list[int] = []
        chunks = []
        resync: list[str] = []
        for i, row in enumerate(req.rows):
            st = self._update(row)
            if st is None:
                resync.append(row.req_id)
                continue
            if row.num_drafts <= 0 or not st.context:
                continue
            k = self._draft_limit(row, st)
            if k <= 0:
                continue
            if not st.sampling.greedy and not writer.available:
                self._no_probs_slot(row.req_id)
                continue
            chunks.append(self._context_chunk(row.req_id, st))
            order.append(i)
            jobs[i] = k
        probs: dict[int, list[torch.Tensor]] = {}
        in_place = writer if self._fits_in_place(req, order, writer) else None
        self._draft_chains(req, order, chunks, jobs, drafts, probs, slot=in_place)
        no_room = set(self._end_step(drafts))
        status = [NO_ROOM if i in no_room else DRAFTED if drafts[i] else NONE for i in range(len(req.rows))]
        probs_slot, probs_rows = self._publish_probs(req, drafts, probs, writer)
        if self.trace is not None:
            self._trace_answer(req, drafts, status, time.perf_counter() - t0)
        return StepResponse(req.step, drafts, {}, time.perf_counter() - t0, resync,
                            live_requests=len(self.reqs), free_blocks=self.runner.num_free_blocks,
                            row_status=status, probs_slot=probs_slot, probs_rows=probs_rows,
                            probs_capped=self.probs_capped)

    # ---- the K-step drafting loop (both modes) ------------------------------------------------------
    def _context_chunk(self, req_id: str, st: _ReqState) -> tuple[str, list[int], int]:
        """The chunk that feeds a request's context from its first token without KV (at least the last
        one, whose logits give the first draft); its earlier drafts' KV is dropped."""
        if not self.runner.has_request(req_id):
            self.runner.add_request(req_id)
        start = min(self.runner.num_computed(req_id), len(st.context) - 1)
        self.runner.truncate(req_id, start)
        st.drafted, st.draft_logits = [], []
        return req_id, st.context[start:], start

    def _fits_in_place(self, req: StepRequest, order: list[int], writer: SlotWriter) -> bool:
        """Whether the sampled rows of `order` can be written straight into `writer`'s slot: a slot row
        each beside a one-hot row for every other row (`fit_rows` would keep them all)."""
        if not writer.available:
            return False
        sampled = sum(1 for i in order if not self.reqs[req.rows[i].req_id].sampling.greedy)
        return 0 < sampled <= writer.ring.rows - (len(order) - sampled)

    def _draft_chains(self, req: StepRequest, order: list[int], chunks: list, jobs: dict[int, int],
                      drafts: list[list[int]], probs: dict[int, list[torch.Tensor]],
                      evictable: set[int] | None = None, slot: SlotWriter | None = None) -> None:
        """Draft `jobs[row]` more tokens for each row of `order`, one batched forward per position: feed
        each row's chunk (its context, or its last draft), choose its next draft (`_choose`), feed that.
        A fed draft has KV afterwards (it joins `st.drafted`); sampled drafts' q' go to `probs[row]`, or with
        `slot` straight into that ring slot, one batched write per forward (`SlotWriter.put_positions`). Rows
        the KV cache cannot hold stop early (`_fit`; with `evictable`, only those rows let go of their KV)."""
        order, chunks = self._fit(req.rows, order, chunks, evict=True, evictable=evictable)
        while chunks:
            logits = self._forward(chunks)
            positions = [len(drafts[i]) for i in order]
            tokens, qs, batch = self._choose([c[0] for c in chunks], logits, positions)
            if slot is not None and batch is not None:
                sampled, q = batch
                slot.put_positions([order[n] for n in sampled], [positions[n] for n in sampled], q)
                qs = [None] * len(qs)
            next_order, next_chunks = [], []
            for n, (i, (rid, _, _)) in enumerate(zip(order, chunks, strict=True)):
                st = self.reqs[rid]
                if drafts[i]:  # the fed token was its last draft (st.drafted == drafts[i][:-1]): it has KV now
                    st.drafted.append(drafts[i][-1])
                drafts[i].append(tokens[n])
                if self.keep_logits:
                    st.draft_logits.append((logits, n))
                if qs[n] is not None:
                    probs.setdefault(i, []).append(qs[n])
                jobs[i] -= 1
                if jobs[i] > 0:
                    next_order.append(i)
                    next_chunks.append((rid, [tokens[n]], self.runner.num_computed(rid)))
            order, chunks = self._fit(req.rows, next_order, next_chunks)

    def _forward(self, chunks, num_logits=1) -> torch.Tensor:
        if self.trace is None:
            return self._model_forward(chunks, num_logits)
        t0 = time.perf_counter()
        logits = self._model_forward(chunks, num_logits)
        self.runner.synchronize()  # on CUDA the clock must see the forward, not its launch
        self.trace.forward(sum(len(c[1]) for c in chunks), logits.shape[0], time.perf_counter() - t0)
        return logits

    def _model_forward(self, chunks, num_logits=1) -> torch.Tensor:
        return self.runner.forward(chunks, num_logits=num_logits)[:, : self.vocab_size]

    # ---- the replay trace of `mode: sync` (drafter/trace.py) -------------------------------------------
    def _trace_lookups(self, req: StepRequest) -> None:
        """Start the step's record: the verification time and, per row, the outcome of its last drafts."""
        rec = self.trace.begin_step(req.step, len(req.rows), verify_s=self.trace.verify_since_answer(req.sent_at),
                                    sent_at=req.sent_at)
        for row in req.rows:
            st, sent = self.reqs.get(row.req_id), self._trace_sent.pop(row.req_id, None)
            out = (derive_outcome(sent, row.new_tokens)
                   if sent and st is not None and row.start == len(st.context) else None)
            spec = st.sampling if st is not None else (row.sampling or SamplingSpec())
            rec["rows"].append({"id": row.req_id, "st": "new" if st is None else "drafted",
                                "a": out.accepted if out else -1, "t": out.bonus if out else -1,
                                "k": len(sent or ()), "new": len(row.new_tokens), "temp": spec.temperature})

    def _trace_answer(self, req: StepRequest, drafts: list[list[int]], status: list[str], answer_s: float) -> None:
        for row, rec, d, st in zip(req.rows, self.trace.rec["rows"], drafts, status, strict=True):
            rec.update(served=len(d), answer=st)
            if d:
                self._trace_sent[row.req_id] = list(d)
        self.trace.rec["answer_s"] = answer_s

    def _choose(self, req_ids: list[str], logits: torch.Tensor, depths: list[int]
                ) -> tuple[list[int], list[torch.Tensor | None], tuple[list[int], torch.Tensor] | None]:
        """Each row's next draft and the q' it was drawn from: the argmax (q' None) for greedy requests; for
        sampled ones one batched `sample_proposals` call, with Saguaro's F and C per row (`_scaling`) at
        the draft's depth. Also (the sampled rows, their q' `[n, vocab]`) as one tensor, or None."""
        qs: list[torch.Tensor | None] = [None] * len(req_ids)
        states = [self.reqs[rid] for rid in req_ids]
        sampled = [n for n, st in enumerate(states) if not st.sampling.greedy]
        tokens = logits.argmax(dim=-1).tolist() if len(sampled) < len(states) else [0] * len(states)
        if not sampled:
            return tokens, qs, None
        scaling = [self._scaling(states[n], depths[n]) for n in sampled]
        lg = logits if len(sampled) == len(states) else logits[torch.tensor(sampled, device=logits.device)]
        drawn, q = sample_proposals(lg, [states[n].sampling for n in sampled],
                                    [states[n].generator for n in sampled],
                                    [f for f, _ in scaling], [c for _, c in scaling])
        for n, tok, row in zip(sampled, drawn.tolist(), q, strict=True):
            tokens[n], qs[n] = tok, row
        return tokens, qs, (sampled, q)

    def _scaling(self, st: _ReqState, depth: int) -> tuple[int, float]:
        """Saguaro sampling's (F, C) for a request's draft at `depth`: none in `mode: sync`."""
        return 0, 1.0

    def _publish_probs(self, req: StepRequest, drafts: list[list[int]], probs: dict[int, list[torch.Tensor]],
                       writer: SlotWriter | None = None) -> tuple[int, list[int]]:
        """Copy the sampled rows' q' into a proposal-ring slot (`writer`'s, or a new one; bitwise: the q'
        their tokens were drawn from); without a free slot those rows get no drafts this step (exact, just
        slower). So do the sampled rows beyond what the slot holds beside a one-hot row per other drafted row
        (`fit_rows`; the ring's rows are `saguaro.max_sampled_rows`): counted in `probs_capped`."""
        self.probs_capped = 0
        if writer is not None and writer.rows:  # slot rows taken while drafting: keep those with drafts
            writer.compact(lambda i: bool(drafts[i]))
        # In answer order (async adds jit rows after the hits): slot rows then follow the batch, the layout
        # in which the target's sampler reads them without copying (patches/model_runner.aligned_draft_probs)
        rows = sorted(i for i, p in probs.items() if p and drafts[i])
        if writer is None:
            if not rows:
                return -1, []
            writer = SlotWriter(self.probs_ring, req.step)
        if rows and not writer.available:
            for i in rows:
                self._no_probs_slot(req.rows[i].req_id)
                drafts[i] = []
            return -1, []
        if rows:
            rows, capped = fit_rows(rows, drafts, writer.ring.rows)
            for i in capped:
                drafts[i] = []
            self.probs_capped = len(capped)
        try:
            writer.put_rows([(i, probs[i][: len(drafts[i])]) for i in rows])
        except BaseException:
            writer.abandon()
            raise
        return writer.finish()

    def _no_probs_slot(self, req_id: str) -> None:
        self.num_no_probs_slot += 1
        if self.num_no_probs_slot == 1:
            logger.warning("no free proposal slot (or no proposal ring): sampled request %s gets no drafts this "
                           "step; further occurrences are only counted", req_id)

    def _fit(self, rows, active, chunks, evict: bool = False, evictable: set[int] | None = None):
        """Reserve KV blocks for each chunk, smallest need first (so a full cache serves as many rows as it
        can), making room from requests absent from this step first. Rows that still do not fit get no
        more drafts this step; with `evict`, those in `evictable` (default: all) also let go of their KV, so
        that one row's blocks can serve the others instead of every row stalling on a full cache."""
        protect = {r.req_id for r in rows}
        need = [self.runner.blocks_needed(rid, len(toks)) for rid, toks, _ in chunks]
        kept: set[int] = set()
        for j in sorted(range(len(chunks)), key=need.__getitem__):
            rid, toks, _ = chunks[j]
            if self._reserve(rid, len(toks), protect):
                kept.add(j)
                continue
            self._no_room.add(active[j])
            if evict and (evictable is None or active[j] in evictable):
                self._evict(rid)
        order = [j for j in range(len(chunks)) if j in kept]
        return [active[j] for j in order], [chunks[j] for j in order]
