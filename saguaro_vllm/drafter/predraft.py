"""The SSD drafter's pre-drafting, off the critical path: after an answer is out, the glue forward (KV of
the drafts just sent and the bonus distribution of every depth), candidate selection, then the branch
steps, one forward per `next` of a generator so that the server loop can look for the next request
between forwards; closing the generator caches what was drafted (a hit on a cut-short branch is topped up
on the critical path). A mixin of `SSDDrafter`: it uses the drafter's runner, request states, sent rounds,
speculation cache and `RoundPlanner`, and decides nothing itself (the planner does).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import groupby
from operator import attrgetter

import torch

from saguaro_vllm.drafter.branches import BranchRoot, BranchRun
from saguaro_vllm.drafter.predictor import MAX_RANK, candidates_from, top_tokens
from saguaro_vllm.drafter.trace import BRANCH, GLUE


def _ranked(top: list[list[int]], drafts, width: int) -> list[list[int]]:
    """Per depth j, the `width` best tokens of its bonus distribution (`top[j]`, best first), x_{j+1}
    excluded for j < K."""
    return [[t for t in row if j >= len(drafts) or t != drafts[j]][:width] for j, row in enumerate(top)]


def _parts(sizes: list[int], cap: int) -> list[list[int]]:
    """Indices of `sizes` in consecutive parts of at most `cap` in all (at least one index each): the glue's
    requests by the logit rows each computes, the candidate selection's roots by their depths."""
    parts, total = [[]], 0
    for i, n in enumerate(sizes):
        if parts[-1] and total + n > cap:
            parts.append([])
            total = 0
        parts[-1].append(i)
        total += n
    return [p for p in parts if p]


def glue_rows(done: int, seq_len: int, k: int, kept: int) -> tuple[int, int, bool]:
    """What a request's glue forward computes: (`have`, `need`, `recompute`). `done`: tokens of its context +
    `k` drafts (`seq_len` in all) the draft has KV for; `kept`: depth distributions kept from drafting them.
    Depths `have`..k come from the forward (`need` logit rows); where neither kept nor recomputable from the
    uncomputed tail, every depth is recomputed from the context (`recompute`: have 0, need k + 1). One rule
    for the glue itself and for the parts it is split into."""
    have = kept if kept >= k and done == seq_len - 1 else 0
    need = min(seq_len - done, k + 1 - have)
    if have + need < k + 1:
        return 0, k + 1, True
    return have, need, False


class PreDrafter:
    def _predraft_rounds(self, req_ids: list[str]) -> Iterator[None]:
        """Generator: glue, then the branch steps, one forward per `next`; closing it caches the branches."""
        t0 = time.perf_counter()
        run: BranchRun | None = None
        stats = self._predraft
        glue_done: bool | None = None  # None: no glue forward yet; False: glue or selection under way
        try:
            yield  # nothing before the answer is out: the first forward runs on the next `advance`
            t0 = time.perf_counter()
            self._flush_garbage()
            trace = self.trace
            if trace is not None:
                trace.phase = GLUE
            roots, scores, protect = [], [], set(req_ids)
            # the glue in parts of at most one draft forward's logit rows (one per request): normally one
            # part; rows whose depth distributions must be recomputed (after an n-gram backup: K + 1 each)
            # spread over several forwards, so the answer never waits for all of them at once
            for part in _parts(self._glue_logit_rows(req_ids), max(1, len(req_ids))):
                glued = self._glue([req_ids[i] for i in part], protect)
                roots += glued[0]
                scores += glued[1]
                if glued[0] and glue_done is None:
                    glue_done = False  # a glue forward ran: from here a cut measures the glue's time
                yield  # each glue forward is one `advance`: the request is looked for between them
            if trace is not None:
                trace.phase = BRANCH
                trace.candidates([r.req_id for r in roots], scores, [r.drafts for r in roots])
            if not roots:
                return
            # steps per branch: the drafts the next round wants (not this round's count, which a cut-short
            # hit or a round of zero drafts would pass on: short rounds would beget short rounds)
            k = max(self._sent[r.req_id].want or r.k for r in roots)
            if self.planner.next_plan is not None:  # planned with the round (`RoundPlanner.predraft_next`)
                plan, pays = self.planner.next_plan
            else:
                plan = self.planner.plan(len(roots), k)
                pays = self.planner.branches_pay_off(plan, len(roots), k)
            # one fan-out per kind of round (draft count, n-gram or not, temperature), not per row (the
            # calibrated allocation is ~0.1 ms each); planned whether or not the branch steps run: whether
            # each outcome lies within its fan-out is the planner's `coverage`, measured in every round
            fans, by_kind = [], {}
            for r in roots:
                sent = self._sent[r.req_id]
                kind = (len(sent.drafts), sent.fast, self.reqs[r.req_id].sampling.temperature)
                if kind not in by_kind:
                    by_kind[kind] = self.planner.fanout_for(kind[0], kind[1], plan.branches, kind[2])
                fans.append(by_kind[kind])
            pre = None
            if trace is not None and trace.rec is not None:
                pre = trace.rec.setdefault("pre", {})
                pre.update(plan=[plan.branches, plan.steps], pays=pays, k=k, batch=len(roots), selected=0)
                for root, fan in zip(roots, fans):
                    pre.setdefault("rows", {}).setdefault(root.req_id, {})["fan"] = fan
            # every root's best tokens per depth (ranks, and the candidates if branching), selected in parts
            # that each take at most about half a draft forward, the request looked for between them: on a
            # CPU core at a 128k vocabulary the selection over K + 1 depths costs several draft forwards; where
            # it is cheap (a GPU) it stays one part with one host transfer
            width = max(MAX_RANK, max((max(f, default=0) for f in fans), default=0))
            tops = []
            for part in _parts([r.k + 1 for r in roots], self.planner.selection_part_rows(len(roots))):
                s0 = time.perf_counter()
                top = top_tokens(torch.cat([scores[i] for i in part]), width + 1)
                self.planner.observe_selection(sum(roots[i].k + 1 for i in part), time.perf_counter() - s0)
                offset = 0
                for i in part:
                    root, fan = roots[i], fans[i]
                    tops.append(top[offset: offset + root.k + 1])
                    offset += root.k + 1
                    sent = self._sent[root.req_id]
                    sent.ranked, sent.fan = _ranked(tops[-1], root.drafts, width), fan
                if pre is not None:
                    pre["selected"] = len(tops)  # the replay counts coverage for these roots only
                if part[-1] < len(roots) - 1:
                    yield
            glue_s, glue_done = time.perf_counter() - t0, True
            self.planner.switch.observe_glue(len(roots), glue_s)
            if pre is not None:
                pre["glue_s"] = glue_s
            stats.budget, stats.plan_steps = plan.branches, plan.steps
            if not pays:
                stats.skipped = True
                return
            candidates = []
            for root, fan, root_top in zip(roots, fans, tops, strict=True):
                if not self._sent[root.req_id].fast:
                    self._fanout = fan
                candidates.append(candidates_from(root_top, root.drafts, fan))
            run = BranchRun(self.runner, roots, candidates, num_steps=plan.steps, propose=self._propose_branches,
                            keep_logits=True, vocab_size=self.vocab_size,
                            is_greedy=lambda req_id: self.reqs[req_id].sampling.greedy)
            self._run = run
            stats.dropped = run.dropped
            stats.fork_copies, stats.branch_blocks = run.fork_copies, run.growth_blocks
            while not run.done:
                s0 = time.perf_counter()
                rows = run.live_rows
                run.step()  # ends with its tokens' transfer to the host: the forward is done on any device
                seconds = time.perf_counter() - s0
                self.planner.record_forward(rows, seconds, parents=min(len(roots), rows))
                if trace is not None:
                    trace.forward(rows, rows, seconds)
                yield
        finally:
            if glue_done is False:  # the request came before glue and selection were done: they take at
                glue_s = time.perf_counter() - t0  # least what elapsed (the planner's fallback weighs it)
                self.planner.switch.observe_glue(len(req_ids), glue_s)
                if self.trace is not None and self.trace.rec is not None:
                    self.trace.rec.setdefault("pre", {})["glue_s"] = glue_s
            if run is not None:  # per request: its branches (contiguous) into the cache at once
                for req_id, branches in groupby(run.finish(), attrgetter("req_id")):
                    sent = self._sent.get(req_id)
                    branches = list(branches)
                    kept = [b for b in branches if b.tokens] if sent is not None else []
                    if kept:
                        self.cache.put_many(req_id, kept, sent.round_id)
                    if len(kept) < len(branches):
                        has = self.runner.has_request
                        self.runner.free_many([b.seq_id for b in branches
                                               if (not b.tokens or sent is None) and has(b.seq_id)])
            stats.predraft_s = time.perf_counter() - t0
            if self.trace is not None and self.trace.rec is not None and run is not None:
                self.trace.rec.setdefault("pre", {}).update(steps_done=run.steps_done, dropped=run.dropped)

    def _glue_logit_rows(self, req_ids: list[str]) -> list[int]:
        """Per request, the logit rows its glue computes (`_glue`'s rule, read without changing anything)."""
        out = []
        for rid in req_ids:
            st, sent = self.reqs.get(rid), self._sent.get(rid)
            if st is None or sent is None:
                out.append(0)
                continue
            k = len(sent.drafts)
            seq_len = len(st.context) + k
            done = min(self.runner.num_computed(rid) if self.runner.has_request(rid) else 0, seq_len - 1)
            out.append(glue_rows(done, seq_len, k, len(st.draft_logits))[1])
        return out

    def _glue(self, req_ids: list[str], protect: set[str]) -> tuple[list[BranchRoot], list[torch.Tensor]]:
        """Feed every token of context + drafts the draft has no KV for (normally just x_K; after an
        n-gram backup the new context tail and all drafts; for a round of zero drafts, e.g. a new request
        left undrafted at a busy step, its whole uncomputed context: off the critical path), and gather
        the K+1 bonus distributions. `protect`: the round's requests, whose KV no reservation may evict."""
        chunks, wanted, items = [], [], []
        for rid in req_ids:
            st, sent = self.reqs.get(rid), self._sent.get(rid)
            if st is None or sent is None or len(st.context) != sent.context_len:
                continue
            seq = st.context + sent.drafts
            if not self.runner.has_request(rid):
                self.runner.add_request(rid)
            done = self.runner.num_computed(rid)
            k = len(sent.drafts)
            if done >= len(seq):  # a round of zero drafts on a fully computed context: recompute its last token
                self.runner.truncate(rid, len(seq) - 1)
                done = len(seq) - 1
            have, need, recompute = glue_rows(done, len(seq), k, len(st.draft_logits))
            if recompute:
                self.runner.truncate(rid, max(0, sent.context_len - 1))
                done = self.runner.num_computed(rid)
            if not self._reserve(rid, len(seq) - done, protect=protect):
                continue  # no room for this request's pre-draft (its drafts are out already)
            chunks.append((rid, seq[done:], done))
            wanted.append(need)
            items.append((rid, st, sent, have))
        if not chunks:
            return [], []
        logits = self._forward(chunks, num_logits=wanted)
        roots, scores = [], []
        offset = 0
        for (rid, st, sent, have), need in zip(items, wanted, strict=True):
            rows = logits[offset: offset + need]
            offset += need
            kept = list(st.draft_logits[:have])
            st.drafted = list(sent.drafts)  # all drafts have KV now
            st.draft_logits = []
            roots.append(BranchRoot(rid, sent.context_len, tuple(sent.drafts)))
            scores.append(torch.cat([torch.stack([t[r] for t, r in kept]), rows]) if kept else rows)
        return roots, scores

    def _propose_branches(self, req_id: str, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        st = self.reqs[req_id]
        if st.sampling.greedy:
            return logits.argmax(dim=-1), None
        return self._sample(st, logits, depth=self._run.steps_done - 1)
