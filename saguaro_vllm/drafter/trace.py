"""The drafter's opt-in replay trace (`saguaro.trace_dir`): what `saguaro-vllm project` needs to replay a run
through the product's own policy code under another cost model (docs/projection.md).

One gzipped JSON-lines file per drafter process: a header line (`"kind": "header"`: mode, K, options), then
one record per step (`"kind": "step"`). A step's record holds the step's answer (per row: status, the
looked-up outcome and its candidate rank, what was served) and, for `mode: async`, the pre-draft that
followed the answer (glue, plan, per-row fan-out and ranked candidates, branch forwards), so it is written
when the next step begins. Every draft forward is listed in order with its phase, tokens fed, logit rows and
seconds. Records are streamed (one `write` per step) and the file stops growing at `trace_max_mb` (one log
line); when tracing is off the drafter holds `None` and pays one `is not None` test per hook.
"""
from __future__ import annotations

import gzip
import json
import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("saguaro_vllm.drafter")

#: Trace format version (bumped on any incompatible change of the records).
VERSION = 1
#: Ranked candidates recorded per depth (the predictor's own order, the depth's draft token excluded).
WIDTH = 64
#: Forward phases: critical-path drafting (jit misses, top-ups, `sync` drafting), the pre-draft's glue, a
#: branch step.
NOW, GLUE, BRANCH = "now", "glue", "branch"
#: Records between flushes of the compressed stream to the file.
FLUSH_EVERY = 8


class TraceRecorder:
    """Streams step records into one gzipped JSON-lines file, bounded by `max_bytes` of compressed output."""

    def __init__(self, path: str | Path, max_bytes: int, header: dict):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._raw = open(self.path, "wb")  # noqa: SIM115 (closed by `close`)
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=6)
        self.full = False
        self.records = 0
        self.rec: dict | None = None  # the step being recorded (written when the next one begins)
        self.phase = NOW
        self._answered_at: float | None = None
        #: per request, the WIDTH-wide candidates of its round in flight (its lookup records the bonus rank)
        self.ranked: dict[str, list[list[int]]] = {}
        self._write({"kind": "header", "version": VERSION, "width": WIDTH, "created": time.time(), **header})

    @classmethod
    def open(cls, options: dict, header: dict) -> TraceRecorder | None:
        """A recorder under `options["trace_dir"]`, or None when tracing is off."""
        trace_dir = options.get("trace_dir")
        if not trace_dir:
            return None
        path = Path(trace_dir) / f"trace-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl.gz"
        rec = cls(path, int(float(options.get("trace_max_mb", 256.0)) * 2**20), header)
        logger.info("Saguaro trace: recording to %s (at most %.0f MB)", path, rec.max_bytes / 2**20)
        return rec

    # ---- writing ------------------------------------------------------------------------------------
    def _write(self, obj: dict) -> None:
        if self.full:
            return
        self._gz.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        self.records += 1
        if self.records % FLUSH_EVERY == 0:  # a killed drafter loses at most this many records
            self._gz.flush()
        if self._raw.tell() >= self.max_bytes:
            self.full = True
            self._gz.close()
            logger.warning("Saguaro trace: %s reached its bound of %.0f MB after %d records; recording stopped",
                           self.path, self.max_bytes / 2**20, self.records)

    def flush(self) -> None:
        """Write the step in progress (if any)."""
        if self.rec is not None:
            self._write(self.rec)
            self.rec = None

    def close(self) -> None:
        self.flush()
        if not self.full:
            self._gz.close()
        self._raw.close()
        self.full = True

    # ---- the drafter's hooks ----------------------------------------------------------------------------
    def answered(self) -> None:
        """The answer went out (the verification starts): the clock `sync` verification times use."""
        self._answered_at = time.monotonic()

    def begin_step(self, step: int, batch: int, **fields) -> dict:
        """Write the previous step's record and start this one's; returns it (the drafter fills it in)."""
        self.flush()
        self.phase = NOW
        self.rec = {"kind": "step", "step": step, "batch": batch, "t": time.monotonic(), "rows": [], "fwd": [],
                    **fields}
        return self.rec

    def verify_since_answer(self, sent_at: float) -> float:
        """Seconds from the last answer to the proposer's send of this request (0 before the first answer)."""
        now = time.monotonic()
        sent = sent_at if 0.0 < sent_at <= now else now
        return max(0.0, sent - self._answered_at) if self._answered_at is not None else 0.0

    def forward(self, tokens: int, logits: int, seconds: float) -> None:
        """A draft forward, in order, tagged with the current phase."""
        if self.rec is not None:
            self.rec["fwd"].append([self.phase, tokens, logits, seconds])  # exact: the replay needs the very floats

    def candidates(self, req_ids: list[str], scores: list[torch.Tensor], drafts: list[tuple[int, ...]]) -> None:
        """Per root of the pre-draft: the WIDTH best tokens of each depth's bonus distribution (the depth's
        draft excluded, in the predictor's order: `predictor.top_tokens`) and their draft probabilities."""
        from saguaro_vllm.drafter.predictor import top_tokens

        if self.rec is None or not scores:
            return
        allx = torch.cat(scores).float()
        top = top_tokens(allx, WIDTH + 1)
        probs = torch.softmax(allx, dim=-1)
        pre = self.rec.setdefault("pre", {}).setdefault("rows", {})
        offset = 0
        for rid, row_scores, row_drafts in zip(req_ids, scores, drafts, strict=True):
            toks, ps = [], []
            for j in range(row_scores.shape[0]):
                excluded = row_drafts[j] if j < len(row_drafts) else None
                ranked = [t for t in top[offset + j] if t != excluded][:WIDTH]
                toks.append(ranked)
                ps.append([round(float(p), 5) for p in probs[offset + j, ranked].tolist()])
            offset += row_scores.shape[0]
            pre.setdefault(rid, {}).update({"cand": toks, "p": ps})
            self.ranked[rid] = toks


def rank_of(ranked: list[list[int]] | None, accepted: int, bonus: int) -> int:
    """Where `bonus` ranks among depth `accepted`'s candidates (WIDTH: not among them; -1: unknown)."""
    if ranked is None or accepted >= len(ranked):
        return -1
    row = ranked[accepted]
    return row.index(bonus) if bonus in row else WIDTH


def read_trace(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, step records) of a trace file; a file cut off mid-line (a killed drafter) keeps its whole
    lines."""
    header, steps = None, []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        try:
            for line in f:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break
                if obj.get("kind") == "header":
                    header = obj
                elif obj.get("kind") == "step":
                    steps.append(obj)
        except (EOFError, gzip.BadGzipFile, OSError):
            pass  # a truncated stream: what was read stands
    if header is None:
        raise ValueError(f"{path}: no trace header (not a Saguaro trace?)")
    return header, steps
