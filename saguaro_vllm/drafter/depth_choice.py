"""Online choice of the draft depth (`depth: "auto"`): pure policy, no model.

vLLM verifies whatever number of drafts a row gets, up to the `num_speculative_tokens` the server started
with (K_max; more would overflow its per-position buffers). More drafts per row yield more tokens per
verification, `E(alpha, d) = (1 - alpha^(d+1)) / (1 - alpha)`, but cost verification time (a forward over
`B (1 + d)` tokens; nearly flat on GPUs at small batch, not on every CPU) and, when the pre-draft could not
draft the branches that deep, critical-path forwards to top the hits up. Per step the depth

    d* = argmax_d  E(alpha, d) / (V(B (1 + d)) + T_now(d))

is chosen from the measured acceptance `alpha`, the verification cost model `V` (a line through measured
(tokens verified, seconds) pairs of recent steps) and `T_now(d)`: the draft forwards the missing tail
costs, `(d - s_d) x step(B)` for the hit rows, and d forwards for the misses, where s_d and the hit rate
h_d are those of the pre-draft a round at depth d would plan (the caller's `outlook`). The change needs a margin (`HYSTERESIS`) over the current depth's estimate, so the depth does
not flap between two near-equal choices; and while the verification samples do not span enough token
counts to fit a slope, every `EXPLORE_EVERY`-th step tries another depth (cycling 1..K_max), so the slope is
measured rather than assumed flat.
"""
from __future__ import annotations

from collections import deque

from saguaro_vllm.drafter.backup import expected_tokens
from saguaro_vllm.drafter.predictor import StepCostModel

#: A new depth must beat the current depth's estimated tokens per second by this factor.
HYSTERESIS = 1.02
#: Verification samples kept (tokens verified, seconds).
SAMPLES = 64
#: Token counts that must appear among the samples before the slope is trusted.
MIN_DISTINCT = 3
#: Without enough distinct token counts, every this many steps try another depth.
EXPLORE_EVERY = 8


def depth_rate(d: int, batch: int, alpha: float, hit_rate: float, predraft_steps: int, verify: StepCostModel,
               draft: StepCostModel) -> float:
    """Estimated tokens per second of one row at depth d (see the module doc). `verify` is a line in
    tokens verified, `draft` in rows per draft forward.

    >>> flat, draft = StepCostModel(0.1, 0.0), StepCostModel(0.01, 0.001)
    >>> [round(depth_rate(d, 1, 0.9, 1.0, 8, flat, draft), 1) for d in (2, 5, 8)]  # all hits, flat: deeper
    [27.1, 46.9, 61.3]
    >>> steep = StepCostModel(0.1, 0.03)  # each verified token adds 30 ms
    >>> [round(depth_rate(d, 1, 0.6, 1.0, 8, steep, draft), 1) for d in (2, 5, 8)]
    [10.3, 8.5, 6.7]
    """
    tokens = expected_tokens(alpha, d)
    topup = max(0, d - predraft_steps)
    now_s = (hit_rate * topup + (1.0 - hit_rate) * d) * draft.step_s(batch)
    return tokens / (verify.step_s(batch * (1 + d)) + now_s)


class DepthChoice:
    """The depth each row gets this step, learned from the verification times the drafter measures."""

    def __init__(self, k_max: int, start: int | None = None):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self.depth = min(start or k_max, k_max)
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self._steps = 0
        self._explore = 0

    def observe(self, tokens_verified: int, seconds: float) -> None:
        """One verification: the tokens it checked (rows + drafts) and how long it took."""
        if tokens_verified > 0 and seconds > 0:
            self._samples.append((float(tokens_verified), seconds))

    def verify_cost(self) -> StepCostModel | None:
        """Verification seconds as a line in tokens verified (None before 3 samples)."""
        return StepCostModel.fit(list(self._samples)) if len(self._samples) >= 3 else None

    def explored(self) -> bool:
        return len({x for x, _ in self._samples}) >= MIN_DISTINCT

    def choose(self, batch: int, alpha: float, draft: StepCostModel | None,
               outlook: dict[int, tuple[float, int]]) -> int:
        """This step's depth: `self.depth`, the current choice, or on an exploring step another one.
        `outlook[d]`: (hit rate, branch steps) of the pre-draft a round at depth d would plan."""
        self._steps += 1
        verify = self.verify_cost()
        if not self.explored() and self._steps % EXPLORE_EVERY == 0 and self.k_max > 1:
            self._explore = self._explore % self.k_max + 1
            if self._explore == self.depth:
                self._explore = self._explore % self.k_max + 1
            return self._explore
        if verify is None or draft is None:
            return self.depth
        rate = {d: depth_rate(d, batch, alpha, *outlook[d], verify, draft) for d in range(1, self.k_max + 1)}
        best = max(rate, key=rate.get)
        if rate[best] > HYSTERESIS * rate[self.depth]:
            self.depth = best
        return self.depth
