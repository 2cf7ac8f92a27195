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

import numpy as np
import torch

from saguaro_vllm.drafter.kv_cache import OutOfBlocksError
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.sampling import proposal_probs, sample_from
from saguaro_vllm.transport import RowUpdate, SamplingSpec, StepRequest, StepResponse

logger = logging.getLogger("saguaro_vllm.drafter")


@dataclasses.dataclass
class _ReqState:
    sampling: SamplingSpec
    generator: torch.Generator | None
    context: list[int] = dataclasses.field(default_factory=list)
    drafted: list[int] = dataclasses.field(default_factory=list)  # drafts with KV after the context
    #: with `keep_logits`: the draft logits each draft of the last step was chosen from ([vocab] each);
    #: row j is the depth-j bonus distribution that SSD's outcome prediction needs (drafter/branches.py).
    draft_logits: list[torch.Tensor] = dataclasses.field(default_factory=list)


class SyncDrafter:
    def __init__(self, runner: DraftModelRunner, vocab_size: int, keep_logits: bool = False):
        self.runner = runner
        self.vocab_size = vocab_size
        self.keep_logits = keep_logits
        self.reqs: dict[str, _ReqState] = {}
        self.num_out_of_blocks = 0

    # ---- the server loop's hooks (SSD does work between requests; sync drafting does none) ----------
    busy = False

    def answered(self) -> None:
        """The answer of the last `step` went out."""

    def advance(self) -> None:
        """Work between requests: none in `mode: sync`."""

    # ---- request bookkeeping --------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        if self.runner.has_request(req_id):
            self.runner.free_request(req_id)

    def _update(self, row: RowUpdate) -> _ReqState | None:
        """Append the row's new committed tokens; None if they do not continue the context we hold."""
        st = self.reqs.get(row.req_id)
        if row.start != (len(st.context) if st else 0):
            self.free(row.req_id)
            return None
        if st is None:
            spec = row.sampling or SamplingSpec()
            gen = None
            if not spec.greedy:
                gen = torch.Generator(device=self.runner.device)
                gen.manual_seed(spec.seed if spec.seed is not None else int.from_bytes(np.random.bytes(7), "little"))
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
    def step(self, req: StepRequest) -> StepResponse:
        t0 = time.perf_counter()
        for rid in req.finished:
            self.free(rid)
        drafts: list[list[int]] = [[] for _ in req.rows]
        probs: dict[int, list[np.ndarray]] = {}
        active: list[int] = []
        chunks = []
        resync: list[str] = []
        for i, row in enumerate(req.rows):
            st = self._update(row)
            if st is None:
                resync.append(row.req_id)
                continue
            if row.num_drafts <= 0 or not st.context:
                continue
            if not self.runner.has_request(row.req_id):
                self.runner.add_request(row.req_id)
            start = min(self.runner.num_computed(row.req_id), len(st.context) - 1)
            self.runner.truncate(row.req_id, start)
            chunks.append((row.req_id, st.context[start:], start))
            active.append(i)
        active, chunks = self._fit(req.rows, active, chunks)
        k_max = max((req.rows[i].num_drafts for i in active), default=0)
        for s in range(k_max):
            if not chunks:
                break
            logits = self.runner.forward(chunks)[:, : self.vocab_size]
            next_chunks, next_active = [], []
            for row_i, (rid, _, start), lg in zip(active, chunks, logits):
                row, st = req.rows[row_i], self.reqs[req.rows[row_i].req_id]
                tok = self._choose(st, lg, probs.setdefault(row_i, []) if not st.sampling.greedy else None)
                drafts[row_i].append(tok)
                if self.keep_logits:
                    st.draft_logits.append(lg)
                if s + 1 < row.num_drafts:
                    st.drafted.append(tok)
                    next_chunks.append((rid, [tok], self.runner.num_computed(rid)))
                    next_active.append(row_i)
            active, chunks = self._fit(req.rows, next_active, next_chunks)
        out_probs = {i: np.stack(p) for i, p in probs.items() if p}
        return StepResponse(req.step, drafts, out_probs, time.perf_counter() - t0, resync,
                            live_requests=len(self.reqs), free_blocks=self.runner.num_free_blocks)

    def _choose(self, st: _ReqState, logits: torch.Tensor, probs_out: list | None) -> int:
        if probs_out is None:
            return int(logits.argmax())
        q = proposal_probs(logits[None], st.sampling)[0]
        tok = int(sample_from(q[None], st.generator)[0])
        probs_out.append(q.cpu().numpy())
        return tok

    def _fit(self, rows, active, chunks):
        """Reserve KV blocks for each chunk; requests that do not fit get no more drafts this step."""
        kept_a, kept_c = [], []
        for i, ch in zip(active, chunks):
            rid, toks, _ = ch
            try:
                self.runner.reserve(rid, len(toks))
            except OutOfBlocksError:
                self.num_out_of_blocks += 1
                logger.warning("draft KV cache full: request %s gets no drafts this step", rid)
                continue
            kept_a.append(i)
            kept_c.append(ch)
        return kept_a, kept_c
