"""Whether the next SSD round pre-drafts at all, or drafts as `mode: sync` does: pure policy, no model.

SSD's pre-draft (glue forward, candidate selection, branch steps) runs while the target verifies, and
the answer waits for the part of it still in flight when the request comes (lateness). Where the glue
alone does not fit inside the verification, or where what the pre-draft saves is eaten by its lateness,
`sync` is faster: a round that does not pre-draft leaves the drafter idle during the verification and
drafts every row just in time after it, exactly as `sync` does (no glue, no lateness, no n-gram backup).

`PreDraftSwitch` decides per round from measurements only:
- the glue alone outlasts the verification (no branch can be ready without the answer waiting for the
  glue and a branch step): fall back;
- the measured tokens per second of steps after a pre-draft against those after none, each measured near
  the current batch (or, before any such step, what `sync` drafting would cost by the step-cost model,
  with a margin): the slower way goes;
  from the fallback, pre-drafting comes back only with a lead of RESUME_MARGIN, so measurements within
  their noise of each other keep the mode (each change's first round pays for it: no branches yet);
- either way, the other mode is probed now and then (`PROBE_ROUNDS` in a row), so the choice follows the
  workload: pre-drafting resumes where its costs come back. A probe costs what the losing mode costs
  (pre-drafting beside the verification slows it where the cores share caches and memory bandwidth), so
  each probe that keeps the mode doubles the wait for the next, from `PROBE_EVERY` rounds up to
  `PROBE_EVERY_MAX`; a change of mode, or of the batch by `REPROBE_BATCH_CHANGE`x since the last probe,
  starts again at `PROBE_EVERY`.
A step's figures belong to the round before it: the pre-draft (or its absence) ran during that step's
verification and decided its hits, lateness and answer time.
"""
from __future__ import annotations

import collections
import dataclasses

from saguaro_vllm.drafter.predictor import StepCostModel

#: Weight each step's tokens and seconds lose per later step of the same mode (a memory of ~5 steps:
#: a probe of PROBE_ROUNDS rounds outweighs the steps measured before it).
RATE_DECAY = 0.8
#: Steps of a mode measured before its rate takes part in the decision (a request's first steps have no
#: branches to hit yet).
MIN_STEPS = 4
#: Pre-drafting gives way to the step-cost model's estimate of `sync` drafting only where it is below this
#: share of it: the estimate leaves out the host time and contention of real `sync` steps, so a close call
#: waits for a probe that measures them.
ESTIMATE_MARGIN = 0.85
#: Measured pre-drafting resumes from the fallback only this far ahead of measured `sync` drafting: the
#: decayed rates of either mode move with the batch's make-up, and without a margin a tie switches modes
#: every few rounds, each change paying a round without branches; at a tie `sync` drafting stays, as it
#: costs no pre-draft work on the drafter's cores.
RESUME_MARGIN = 1.05
#: Rounds in the fallback (or pre-drafting with its lead not clear) before the first probe of the other mode;
#: each probe that keeps the mode doubles it ...
PROBE_EVERY = 16
#: ... up to this many rounds (~4 % of rounds in probes instead of 16 %).
PROBE_EVERY_MAX = 64
#: A batch this many times larger or smaller than at the last probe probes at PROBE_EVERY again: the glue, the
#: branch steps and the verification scale differently with the batch, so the last probe's verdict is stale.
REPROBE_BATCH_CHANGE = 2.0
#: Rounds in a row a probe runs the other mode (the first one's step pays the switch: no branches yet).
PROBE_ROUNDS = 3
#: Pre-drafting keeps going without probing `sync` while its measured rate is this far ahead of the one
#: estimated for `sync` by the step-cost model.
CLEAR_LEAD = 1.3
#: The switch's reason while a mode's rate is not measured yet (a probe that ends so does not count as lost).
NOT_MEASURED = "not measured yet"
#: Glue timings kept (requests glued, seconds): the last few, so that one probe's rounds replace them.
GLUE_SAMPLES = 6


@dataclasses.dataclass
class _Rate:
    """Decayed sums of one mode's steps: tokens committed, seconds (verification, lateness, answer) and
    rows (the batch they were measured at)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: float = 0.0
    rows: float = 0.0

    def add(self, tokens: float, seconds: float, rows: int = 0) -> None:
        self.tokens = RATE_DECAY * self.tokens + tokens
        self.seconds = RATE_DECAY * self.seconds + seconds
        self.steps = RATE_DECAY * self.steps + 1.0
        self.rows = RATE_DECAY * self.rows + rows

    @property
    def batch(self) -> float:
        """The mean batch of the steps measured (0: not recorded)."""
        return self.rows / self.steps if self.steps else 0.0

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


class PreDraftSwitch:
    """Pre-draft or `sync` drafting, round by round (module docstring); `reason` says why the last change."""

    def __init__(self) -> None:
        self.predrafting = True
        self.reason = "default"
        self.rates = {True: _Rate(), False: _Rate()}
        self.samples = {True: 0, False: 0}  # steps measured per mode (undecayed)
        self.glue: collections.deque[tuple[int, float]] = collections.deque(maxlen=GLUE_SAMPLES)
        self._since_probe = 0
        self._probe_left = 0
        self.probe_every = PROBE_EVERY  # rounds between probes (doubled by each probe that keeps the mode)
        self._probe_batch: int | None = None  # the batch of the last probe's first round
        self._probe_ended = False  # the last probe's rounds are all decided; its verdict is not yet drawn
        self.probing = False  # the round just decided is one of a probe of the other mode
        self._glue_fit: tuple[tuple, StepCostModel | None] = ((), None)

    # ---- measurements -------------------------------------------------------------------------------
    def observe_step(self, predrafted: bool, tokens: int, seconds: float, rows: int = 0) -> None:
        """A step after a round that pre-drafted (or not): its committed tokens over its verification,
        lateness and answer time, at a batch of `rows`. A batch `REPROBE_BATCH_CHANGE`x apart from the one
        the mode's rate was measured at starts that rate afresh: tokens per second grow with the batch."""
        if seconds > 0:
            rate = self.rates[predrafted]
            if _apart(rows, rate.batch):
                rate = self.rates[predrafted] = _Rate()
                self.samples[predrafted] = 0
            rate.add(tokens, seconds, rows)
            self.samples[predrafted] += 1

    def observe_glue(self, requests: int, seconds: float) -> None:
        """The pre-draft's work before its branch steps (glue forward and candidate selection), completed."""
        self.glue.append((requests, seconds))

    def glue_s(self, requests: int) -> float | None:
        """Seconds the glue of `requests` requests takes (fitted; None before any is measured)."""
        if not self.glue:
            return None
        samples = tuple(self.glue)
        if samples != self._glue_fit[0]:
            self._glue_fit = (samples, StepCostModel.fit(samples))
        return self._glue_fit[1].step_s(requests)

    def rate(self, predrafted: bool, batch: int | None = None) -> float | None:
        """Measured tokens per second of a mode's steps (None before MIN_STEPS of them, or where they were
        measured at a batch `REPROBE_BATCH_CHANGE`x apart from `batch`: a mode last measured at batch 16
        looks ~10x faster than the other measured at batch 1, which flipped the mode after every batch
        change in the regimes matrix)."""
        if self.samples[predrafted] < MIN_STEPS or _apart(batch, self.rates[predrafted].batch):
            return None
        return self.rates[predrafted].rate

    # ---- the decision --------------------------------------------------------------------------------
    def decide(self, verify_s: float | None, glue_s: float | None, sync_rate_estimate: float | None,
               batch: int | None = None) -> bool:
        """Whether the next round pre-drafts. `verify_s`: the measured verification; `glue_s`: the glue of
        this round's requests (both None before measured). `sync_rate_estimate`: tokens per second `sync`
        drafting would give by the step-cost model (None: unknown), used until `sync` steps are measured.
        `batch`: the round's requests (a large change since the last probe brings the next one forward)."""
        self.probing = False
        if self._probe_left > 0:  # a probe runs its rounds to the end
            self._probe_left -= 1
            self.probing = True
            self._probe_ended = self._probe_left == 0
            return not self.predrafting
        wants, reason = self._preferred(verify_s, glue_s, sync_rate_estimate, batch)
        ended, self._probe_ended = self._probe_ended, False
        if wants != self.predrafting:
            self.predrafting, self.reason = wants, reason
            self._since_probe = 0
            self.probe_every = PROBE_EVERY
            return wants
        if ended and reason != NOT_MEASURED:  # the probe measured both modes and the mode stays: wait longer
            self.probe_every = min(2 * self.probe_every, PROBE_EVERY_MAX)
        if _apart(batch, self._probe_batch):
            self.probe_every = PROBE_EVERY
        self._since_probe += 1
        if self._since_probe >= self.probe_every and self._should_probe(sync_rate_estimate, batch):
            self._since_probe = 0
            self._probe_left = PROBE_ROUNDS - 1
            self._probe_ended = PROBE_ROUNDS == 1
            self._probe_batch = batch
            self.probing = True
            return not self.predrafting
        return self.predrafting

    def predraft_probe_next(self) -> bool:
        """Whether the next round is expected to be one of a probe of pre-drafting from the fallback."""
        return not self.predrafting and self._probe_next()

    def _probe_next(self) -> bool:
        """Whether the next round is expected to be one of a probe of the other mode (under way or due)."""
        return self._probe_left > 0 or self._since_probe + 1 >= self.probe_every

    def predraft_expected(self) -> bool:
        """Whether the switch expects the next round to pre-draft: it pre-drafts, a probe of pre-drafting
        runs, or one is due. Rounds drafted as `sync` keep their draft logits (which spare the next glue the
        K + 1 depth distributions per request) only where `RoundPlanner.predraft_expected` (this, and branch
        steps not skipped round after round) says so: kept where they go unused, they hold K forwards'
        logits per step (at batch 64 and a 128k vocabulary ~160 MB, each step on fresh memory)."""
        return self.predrafting or self._probe_next()

    def _preferred(self, verify_s, glue_s, sync_rate_estimate, batch=None) -> tuple[bool, str]:
        """The mode the measurements favour, and why."""
        if verify_s is None:
            return True, "no verification measured yet"
        if glue_s is not None and glue_s > verify_s:
            return False, (f"the glue ({1e3 * glue_s:.1f} ms) takes longer than the verification "
                           f"({1e3 * verify_s:.1f} ms)")
        pre, sync = self.rate(True, batch), self.rate(False, batch)
        measured = sync is not None
        if sync is None:
            sync = sync_rate_estimate
        if pre is None or sync is None:
            return self.predrafting, NOT_MEASURED
        source = "measured" if measured else "estimated"
        if pre < (sync if measured else ESTIMATE_MARGIN * sync):
            return False, f"pre-drafting steps {pre:.1f} tokens/s, sync drafting {sync:.1f} ({source})"
        if measured and not self.predrafting and pre < RESUME_MARGIN * sync:
            return False, (f"pre-drafting steps {pre:.1f} tokens/s, within {RESUME_MARGIN:.2f}x of sync "
                           f"drafting {sync:.1f}")
        return True, f"pre-drafting steps {pre:.1f} tokens/s, sync drafting {sync:.1f} ({source})"

    def _should_probe(self, sync_rate_estimate: float | None, batch: int | None = None) -> bool:
        """In the fallback always; while pre-drafting, only while its lead over `sync` is not clear."""
        if not self.predrafting:
            return True
        pre, sync = self.rate(True, batch), self.rate(False, batch)
        sync = sync if sync is not None else sync_rate_estimate
        return pre is not None and sync is not None and pre < CLEAR_LEAD * sync


def _apart(a: float | None, b: float | None) -> bool:
    """Whether two batches (0 or None: unknown) are `REPROBE_BATCH_CHANGE`x or more apart."""
    return bool(a and b) and max(a, b) >= REPROBE_BATCH_CHANGE * min(a, b)
