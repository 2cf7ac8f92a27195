"""`SaguaroProposer`: the vLLM side of Saguaro, plugged in through vLLM's `custom_class` proposer hook.

vLLM builds it in each worker (last pipeline stage) and calls `propose` once per step after bookkeeping.
It turns each row into the committed tokens the drafter has not seen yet (keyed by the real request id,
which the runner patch provides), asks the drafter process for drafts, and returns at most K tokens per row
(`[]` for prefill chunks). For sampled requests it also builds the exact proposal probabilities for vLLM's
rejection sampler. Only tensor-parallel rank 0 talks to the drafter; other ranks return no drafts (vLLM
only uses rank 0's). Any drafter failure means "no drafts this step", never a failed request.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from saguaro_vllm.frontend.config import ADDITIONAL_CONFIG_KEY
from saguaro_vllm.worker.drafter_client import DrafterClient, DrafterUnavailable
from saguaro_vllm.worker.remote_client import RemoteDrafterClient
from saguaro_vllm.worker.drafter_policy import ResyncBackoff
from saguaro_vllm.worker.metrics import SaguaroMetrics
from saguaro_vllm.worker.rank_placement import placed_config
from saguaro_vllm.shared.proposal_buffers import ProposalRing, assemble, draft_positions, fit_rows, ring_rows, transport_for
from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest


def sampling_spec(params: Any) -> SamplingSpec:
    """The subset of vLLM `SamplingParams` the draft proposal honours."""
    if params is None:
        return SamplingSpec()
    return SamplingSpec(
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k or 0),
        seed=params.seed,
    )


class SaguaroProposer:
    is_saguaro_proposer = True

    def __init__(self, vllm_config: Any):
        from vllm.logger import init_logger

        self.logger = init_logger("vllm.saguaro.proposer")
        # this engine's drafter: its data-parallel rank's placement (and under Ray the reserved GPU)
        self.cfg = placed_config(dict(vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]),
                                 getattr(vllm_config, "parallel_config", None), self._is_output_rank())
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.runner: Any = None
        self.sent: dict[str, int] = {}  # request id -> context tokens already sent to the drafter
        self.finished: list[str] = []
        self.step_id = 0
        self._last_probs: torch.Tensor | None = None
        self._last_prob_req_ids: list[str] | None = None  # the request of each row of `_last_probs`
        self.ring: ProposalRing | None = None
        self._capped_logged = False
        self._generation = 0
        self.resync_backoff = ResyncBackoff()  # counted in `propose` calls with a ready drafter
        self._calls = 0
        self.metrics = SaguaroMetrics(self.cfg, self.logger)
        self.client: DrafterClient | None = None
        if self.cfg.get("target_cores"):
            self._pin_target(self._rank_cores())
        if self._is_output_rank():
            self._create_ring(vllm_config)
            if self.cfg["saguaro"].get("drafter_endpoint"):  # a drafter on another host: connect to it
                self.client = RemoteDrafterClient(self.cfg, self.logger, metrics=self.metrics,
                                                  vocab_size=self.vocab_size, ring=self.ring)
            else:
                self.client = DrafterClient(self.cfg, self.logger, metrics=self.metrics, vocab_size=self.vocab_size)

    def _create_ring(self, vllm_config: Any) -> None:
        """Sampled rows' q comes through shared memory, not the socket (proposal_buffers.py): a ring of
        `ring_rows` rows in the directory the front end checked (resolve.py), one log line, one gauge."""
        max_num_seqs = _max_rows(vllm_config)
        cap = self.cfg.get("saguaro", {}).get("max_sampled_rows", "auto")
        rows = ring_rows(cap, max_num_seqs)
        if rows == 0:
            self.logger.info("Saguaro: no proposal ring (saguaro.max_sampled_rows 0): sampled requests get no "
                             "drafts, greedy ones do")
            self.metrics.on_ring(0)
            return
        device = self._ring_device(vllm_config)
        try:
            self.ring = ProposalRing.create(rows=rows, k=self.k, vocab=self.vocab_size,
                                            base_dir=self.cfg.get("proposal_ring_dir"), device=device)
        except (RuntimeError, OSError) as err:
            if device == "cpu" or self.cfg.get("saguaro", {}).get("proposal_transport") == "device":
                raise
            self.logger.warning("Saguaro: the proposal ring cannot live in %s's memory (%s); it uses shared host "
                                "memory (saguaro.proposal_transport \"host\")", device, err)
            self.ring = ProposalRing.create(rows=rows, k=self.k, vocab=self.vocab_size,
                                            base_dir=self.cfg.get("proposal_ring_dir"))
        self.cfg["proposal_ring"] = self.ring.spec()
        self.logger.info("Saguaro: proposal ring for sampled rows' probabilities in %s (max_num_seqs %d, "
                         "saguaro.max_sampled_rows %s)%s", self.ring.describe(), max_num_seqs, cap,
                         "; a sparse file: memory is used only by the rows written" if self.ring.device == "cpu"
                         else "")
        self.metrics.on_ring(self.ring.nbytes)

    def _ring_device(self, vllm_config: Any) -> str:
        """"cpu" (the shared-memory ring) or the target's CUDA device (`saguaro.proposal_transport`,
        `proposal_buffers.transport_for`)."""
        choice = self.cfg.get("saguaro", {}).get("proposal_transport", "auto")
        target = str(getattr(getattr(vllm_config, "device_config", None), "device", "cpu") or "cpu")
        if target.startswith("cuda") and torch.cuda.is_available():
            target = f"cuda:{torch.cuda.current_device()}"
        if choice == "host" or not target.startswith("cuda"):
            return "cpu"
        if choice == "device" or transport_for(target, str(self.cfg.get("device", "cpu"))) == "device":
            return target
        return "cpu"

    def _rank_cores(self) -> list[int]:
        """CPU: this worker's own cores: its slice of the per-rank lists (one list per local rank, the
        same lists vLLM's multiproc executor binds each rank's OpenMP threads to), so ranks never share."""
        rank_cores = self.cfg.get("target_rank_cores") or [self.cfg["target_cores"]]
        if len(rank_cores) == 1:
            return rank_cores[0]
        from vllm.distributed.parallel_state import get_world_group

        return rank_cores[get_world_group().local_rank]

    def _pin_target(self, cores: list[int]) -> None:
        """CPU: keep the whole target worker on its cores (saguaro_vllm/shared/placement.py says why)."""
        from saguaro_vllm.shared.placement import pin_process

        stuck = pin_process(cores)
        self.logger.info("Saguaro: target worker pinned to cores %s (%d torch threads)%s", cores, len(cores),
                         f"; could not move threads {stuck}" if stuck else "")

    @staticmethod
    def _is_output_rank() -> bool:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            return get_tensor_model_parallel_rank() == 0
        except Exception:  # not initialised (single process)
            return True

    # ---- hooks called by vLLM and by our runner patch ---------------------------------------------
    def load_model(self, target_model: Any = None) -> None:
        """vLLM's model-loading phase: wait (at most `startup_timeout_s`) for the first drafter, so the first
        requests already get drafts; a drafter still loading after that keeps loading in the background."""
        if self.client is not None:
            self.client.wait_ready()

    def bind_runner(self, runner: Any) -> None:
        self.runner = runner

    def on_requests_finished(self, req_ids) -> None:
        for rid in req_ids:
            self.resync_backoff.forget(rid)
            if self.sent.pop(rid, None) is not None:
                self.finished.append(rid)

    def take_last_draft_probs(self) -> torch.Tensor | None:
        """[rows, K, vocab] q for the rejection sampler; row r belongs to `take_last_draft_prob_req_ids()[r]`.
        On CPU a view of a proposal-ring slot, valid until the next `propose` (vLLM reads it before)."""
        probs, self._last_probs = self._last_probs, None
        return probs

    def take_last_draft_prob_req_ids(self) -> list[str] | None:
        ids, self._last_prob_req_ids = self._last_prob_req_ids, None
        return ids

    def flush_finished(self) -> None:
        """vLLM's step that retires the last requests schedules no tokens, so no `propose` follows it: send
        their ids now, so the drafter frees their state (and its request gauge drops) while idle."""
        if self.finished:
            self.propose([], np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int64))

    # ---- the step ------------------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        self._last_probs = self._last_prob_req_ids = None
        if self.ring is not None and len(sampled_token_ids):  # vLLM consumed the last q in this step's sampling
            self.ring.release_held()
        if self.client is None or self.runner is None:
            return drafts
        ready = self.client.poll()  # never waits: a drafter that is (re)starting means no drafts now
        self._sync_generation()
        if not ready:
            if sampled_token_ids:
                self.metrics.on_failure(self.client.state)
            return drafts
        for rid in self.client.take_late_resync():
            self.sent.pop(rid, None)
        self._calls += 1
        req_ids = self.runner.input_batch.req_ids
        rows: list[RowUpdate] = []
        row_index: list[int] = []
        previous: dict[str, int | None] = {}  # what `sent` held before this step, restored if undelivered
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # partial prefill chunk: nothing to draft from yet
                continue
            rid = req_ids[i]
            if self.resync_backoff.skip(rid, self._calls):
                continue
            n = int(num_tokens_no_spec[i])
            start = self.sent.get(rid, 0)
            if start > n:  # cannot happen for an append-only context; resend to be safe
                start = 0
            sampling = None
            if start == 0:
                state = self.runner.requests.get(rid)
                sampling = sampling_spec(state.sampling_params if state is not None else None)
            rows.append(RowUpdate(rid, start, token_ids_cpu[i, start:n].tolist(), self.k, sampling))
            row_index.append(i)
            previous[rid] = self.sent.get(rid)
            self.sent[rid] = n
        if not rows and not self.finished:
            return drafts
        self.step_id += 1
        finished = list(self.finished)
        request = StepRequest(self.step_id, rows, finished, sent_at=time.monotonic())
        t0 = time.perf_counter()
        try:
            resp = self.client.step(request)
        except DrafterUnavailable as err:
            # A new drafter holds nothing (everything is resent, nothing needs freeing). Otherwise keep
            # what a drafter that never saw this step still needs: the finished ids and the rows' tokens.
            if not self._sync_generation():
                if err.delivered:
                    self.finished = self.finished[len(finished):]
                else:
                    for rid, before in previous.items():
                        if before is None:
                            self.sent.pop(rid, None)
                        else:
                            self.sent[rid] = before
            return drafts
        self.finished = self.finished[len(finished):]
        for rid in resp.resync:
            self.sent.pop(rid, None)
            self.resync_backoff.on_resync(rid, self._calls)
        for j, i in enumerate(row_index):
            drafts[i] = resp.drafts[j][: self.k]
        capped = resp.probs_capped
        if resp.probs_slot >= 0:
            capped += self._take_probs(resp, drafts, row_index, req_ids)
        if capped:
            self._on_capped(capped, sum(1 for d in drafts if d))
        self.metrics.on_step(time.perf_counter() - t0, resp.compute_s, len(rows),
                             sum(len(d) for d in drafts), resp.live_requests, resp.free_blocks,
                             resp.row_status, resp.row_depth, resp.ssd,
                             drafted_rows=[bool(drafts[i]) for i in row_index])
        return drafts

    def _sync_generation(self) -> bool:
        """True (and every context forgotten) if the drafter's state was lost since the last call."""
        if self.client.generation == self._generation:
            return False
        self._generation = self.client.generation
        self.sent.clear()
        self.finished.clear()
        self.resync_backoff.clear()
        return True

    def _on_capped(self, capped: int, drafted: int) -> None:
        """Sampled rows left without drafts because the ring has too few rows: counted, logged once."""
        self.metrics.on_capped(capped)
        if not self._capped_logged:
            self._capped_logged = True
            self.logger.warning(
                "Saguaro: %d sampled rows got no drafts this step: the proposal ring has %d rows "
                "(saguaro.max_sampled_rows) and, while a sampled row is verified, every drafted row of the step "
                "needs one (%d drafted rows kept); output is unaffected (those rows decode without "
                "speculation). Further occurrences are only counted (vllm:saguaro_sampled_rows_capped_total); "
                "raise saguaro.max_sampled_rows if it grows", capped, self.ring.rows if self.ring else 0, drafted)

    def _take_probs(self, resp: Any, drafts: list[list[int]], row_index: list[int], req_ids: list[str]) -> int:
        """The rejection sampler's q for this step from the slot the drafter wrote (no copy on CPU, one
        contiguous copy to other devices); one-hot rows for greedy drafts of the same batch. A slot that is
        not held with this answer, or a drafted token its q gives 0, drops the sampled rows' drafts instead
        (exact: they are decoded without speculation this step). Sampled rows that do not fit in the slot
        beside the one-hot rows (the drafter already leaves none) lose their drafts too: returns how many."""
        row_drafts = [drafts[i] for i in row_index]
        slot, rows = resp.probs_slot, resp.probs_rows
        ok = self.ring is not None and self.ring.held(slot, resp.step)
        if ok:
            buf = self.ring.slot(slot)
            # The drafter drew each token from these very floats, so q > 0 there unless the row is torn, stale
            # or not this answer's: the host must know before vLLM gets the drafts. One gather; on a device
            # ring one index transfer that does not wait and one 1-element read, after vLLM's own wait for
            # this step's sampled tokens (nothing else is queued then).
            ok = bool((buf[draft_positions([row_drafts[j] for j in rows], device=buf.device)] > 0).all())
        if not ok:
            self.logger.warning("Saguaro: proposal probabilities of step %d unusable (slot %d not held, or a "
                                "draft without probability); its sampled rows get no drafts", resp.step, slot)
            for j in rows:
                drafts[row_index[j]] = []
            return 0
        rows, capped = fit_rows(rows, row_drafts, self.ring.rows)
        for j in capped:
            drafts[row_index[j]] = row_drafts[j] = []
        if not rows:
            return len(capped)
        # requests the target decodes greedily: vLLM never reads their q (`assemble` leaves their rows alone)
        greedy = getattr(getattr(self.runner, "input_batch", None), "greedy_reqs", None) or ()
        unread = {j for j, d in enumerate(row_drafts) if d and req_ids[row_index[j]] in greedy}
        probs, answer_rows = assemble(buf, rows, row_drafts, self.k, device=self.runner.device, unread=unread)
        self._last_probs = probs
        self._last_prob_req_ids = [req_ids[row_index[j]] for j in answer_rows]
        return len(capped)


def _max_rows(vllm_config: Any) -> int:
    """Rows a step can have: the scheduler's `max_num_seqs` (256 for configs without a scheduler section,
    e.g. reduced test configs). The ring's rows are at most this (`ring_rows`)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return int(getattr(scheduler, "max_num_seqs", None) or 256)
