"""Outcome prediction for SSD (ssd-algorithm.md §3): which verification outcomes to pre-draft, how many per
depth, and how many in all.

- `select_candidates`: the top-f_j bonus tokens per depth j, the drafted x_{j+1} excluded for j < K.
- `allocate_fanout`: f_j ∝ P(a=j)^(1/(1+r)) rounded to the budget M (the hit-maximising shape under a
  power-law miss rate f^-r).
- `AcceptanceEstimate` / `OutcomePredictor`: α estimated online from observed accepted counts, one
  estimate for neural drafts and one for fast backups (random or n-gram tokens are rarely accepted, so
  after such a miss the budget sits at depth 0 until the estimate learns otherwise).
- `OutcomeStats`: calibrated outcome statistics per temperature (P(a=j) measured, the bonus token's rank
  per depth); its `allocate` spends the budget where the expected hit per branch is highest (neural rounds).
- `plan_predraft`: how many branches and steps the pre-drafting gets, from measured timings and measured
  candidate ranks (`RankEstimate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from saguaro_vllm.drafter.backup import expected_tokens, step_rate

#: Exponent of the power-law miss rate P(miss | f) = f^-r. A modelling prior (the per-depth hit counters
#: of the speculation cache can refine it); it only shapes how steeply the fan-out falls with depth.
DEFAULT_R = 1.0


def depth_probs(alpha: float, k: int) -> list[float]:
    """P(a=j) for j = 0..K under a per-token acceptance α: (1-α)α^j for j < K, α^K at K."""
    alpha = min(max(alpha, 0.0), 1.0)
    return [(1 - alpha) * alpha**j for j in range(k)] + [alpha**k]


def allocate_fanout(budget: int, alpha: float, k: int, r: float = DEFAULT_R) -> list[int]:
    """Branches per depth 0..K summing to `budget`: f_j ∝ P(a=j)^(1/(1+r)), largest-remainder rounding
    (ties to the shallower depth).

    >>> allocate_fanout(8, 0.8, 3, r=1.0)  # weights ~ [.45, .40, .36, .72]
    [2, 2, 1, 3]
    """
    if budget < 0 or k < 0 or r < 0:
        raise ValueError(f"need budget >= 0, k >= 0, r >= 0; got {budget}, {k}, {r}")
    weights = [p ** (1.0 / (1.0 + r)) for p in depth_probs(alpha, k)]
    total = sum(weights)
    ideal = [budget * w / total for w in weights]
    fanout = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(k + 1), key=lambda j: (-(ideal[j] - fanout[j]), j))
    for j in by_remainder[: budget - sum(fanout)]:
        fanout[j] += 1
    return fanout


def top_tokens(scores: torch.Tensor, n: int) -> list[list[int]]:
    """Per row of `scores` `[rows, vocab]`, its `n` best token ids, best first, ties to the lower token id
    (exactly a stable descending sort's first n). One `topk` of n + 1: where the n-th best value is strictly
    above the (n+1)-th, the n winners are certain and only their order needs fixing (ties among them to the
    lower id); one host transfer for all rows, no data-dependent shape. Rows whose n-th value is tied past
    the n-th place (integer-like scores, masked tokens) take `_top_tokens_tied` after that transfer: a
    second one, rare with float logits. A full sort of a 128k vocabulary costs ~10 ms per row on a CPU core;
    this ~0.4 ms per row."""
    rows, vocab = scores.shape
    n = min(n, vocab)
    if rows == 0 or n <= 0:
        return [[] for _ in range(rows)]
    x = scores.float()
    vals, idx = torch.topk(x, min(n + 1, vocab), dim=-1)
    clean = vals[:, n - 1] > vals[:, n] if n < vocab else torch.ones(rows, dtype=torch.bool, device=x.device)
    ids = idx[:, :n].sort(dim=-1).values  # ascending ids: a stable sort by value keeps ties lowest id first
    order = torch.argsort(x.gather(-1, ids), dim=-1, descending=True, stable=True)
    packed = torch.cat([ids.gather(-1, order), clean.long()[:, None]], dim=1).tolist()  # one transfer
    out = [row[:n] for row in packed]
    tied = [r for r, row in enumerate(packed) if not row[n]]
    if tied:
        for r, row in zip(tied, _top_tokens_tied(x[tied], n), strict=True):
            out[r] = row
    return out


def _top_tokens_tied(x: torch.Tensor, n: int) -> list[list[int]]:
    """`top_tokens` for rows with ties across the n-th place: the tokens above the n-th value, then the tied
    ones lowest ids first (a running count), gathered by a second `topk`; no data-dependent shape."""
    kth = torch.topk(x, n, dim=-1).values[:, -1:]
    above, tie = x > kth, x == kth
    room = n - above.sum(dim=-1, keepdim=True)
    chosen = above | (tie & (torch.cumsum(tie, dim=-1, dtype=torch.int32) <= room))  # exactly n per row
    ids = torch.topk(chosen.to(torch.uint8), n, dim=-1, sorted=False).indices.sort(dim=-1).values
    order = torch.argsort(x.gather(-1, ids), dim=-1, descending=True, stable=True)
    return ids.gather(-1, order).tolist()


def candidates_from(top: Sequence[Sequence[int]], drafts: Sequence[int], fanout: Sequence[int]) -> list[tuple[int, int]]:
    """`select_candidates` from each depth's best tokens (`top[j]`, best first, at least f_j + 1 of them)."""
    k = len(drafts)
    if len(top) != k + 1 or len(fanout) != k + 1:
        raise ValueError(f"K={k} drafts need {k + 1} score rows and fan-outs, got {len(top)} and {len(fanout)}")
    widest = max(fanout, default=0)
    if widest <= 0:
        return []
    per_depth = []
    for j, f in enumerate(fanout):
        excluded = drafts[j] if j < k else None
        per_depth.append([t for t in top[j] if t != excluded][:f])
    return [(j, toks[rank]) for rank in range(widest) for j, toks in enumerate(per_depth) if rank < len(toks)]


def select_candidates(scores: torch.Tensor, drafts: Sequence[int], fanout: Sequence[int]) -> list[tuple[int, int]]:
    """Candidate outcomes `(depth j, bonus t)` of one request, in priority order.

    `scores` `[K+1, vocab]`: logits (or probabilities) of the depth-j bonus distributions (see
    `PreDrafter._glue`). Depth j < K takes its best f_j tokens other than x_{j+1} (a rejected
    draft is never the bonus token); depth K excludes nothing. Ties go to the lower token id (as the fused
    `saguaro_vllm.ops.select_candidates`). Order: every depth's best token first, then every depth's second,
    and so on, so that dropping from the tail (a full KV cache) loses the least likely outcomes.
    """
    if scores.shape[0] != len(drafts) + 1:
        raise ValueError(f"K={len(drafts)} drafts need {len(drafts) + 1} score rows, got {scores.shape[0]}")
    widest = max(fanout, default=0)
    top = top_tokens(scores, widest + 1) if widest > 0 else [[] for _ in range(scores.shape[0])]
    return candidates_from(top, drafts, fanout)


class DecayedRatio:
    """A ratio of exponentially decayed sums; the prior counts as `prior_weight` observations of `prior`
    and fades like any observation."""

    def __init__(self, prior: float, prior_weight: float = 4.0, decay: float = 0.95):
        if prior < 0 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"bad {type(self).__name__}({prior}, {prior_weight}, {decay})")
        self.decay = decay
        self._num = prior * prior_weight
        self._den = prior_weight

    @property
    def ratio(self) -> float:
        return self._num / self._den

    def _add(self, num: float, den: float) -> None:
        self._num = self.decay * self._num + num
        self._den = self.decay * self._den + den


class AcceptanceEstimate(DecayedRatio):
    """α: accepted drafts over drafts the target examined (a accepted, plus the rejected one when a < K),
    the estimator of a geometric acceptance model truncated at K."""

    def __init__(self, prior: float = 0.6, prior_weight: float = 4.0, decay: float = 0.95):
        if prior > 1.0:
            raise ValueError(f"bad AcceptanceEstimate({prior}, {prior_weight}, {decay})")
        super().__init__(prior, prior_weight, decay)

    @property
    def alpha(self) -> float:
        return self.ratio

    def observe(self, accepted: int, k: int) -> None:
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must lie in 0..{k}, got {accepted}")
        self._add(accepted, accepted + (1 if accepted < k else 0))


class TokensEstimate(DecayedRatio):
    """Mean tokens one verification yields for a kind of row (prior: 1 token, the bonus alone)."""

    def __init__(self, prior: float = 1.0, prior_weight: float = 4.0, decay: float = 0.95):
        super().__init__(prior, prior_weight, decay)

    @property
    def mean(self) -> float:
        return self.ratio

    def observe(self, tokens: int) -> None:
        self._add(tokens, 1)


class OutcomePredictor:
    """Fan-out per depth for a round whose drafts came from the draft model (`fast_backup=False`: a hit or
    a just-in-time neural backup) or from a fast backup (random / n-gram tokens after a miss)."""

    def __init__(self, r: float = DEFAULT_R, neural: AcceptanceEstimate | None = None,
                 backup: AcceptanceEstimate | None = None):
        self.r = r
        self.neural = neural or AcceptanceEstimate()
        self.backup = backup or AcceptanceEstimate(prior=0.0)
        #: tokens per verification of n-gram rows, rows without any n-gram draft counted as their 1 token
        #: (what pre-drafting expects of a miss left to its fast backup)
        self.ngram_tokens = TokensEstimate()
        #: the same over rows that had n-gram drafts (what the per-row backup choice weighs against jit)
        self.ngram_matched = TokensEstimate()

    def observe(self, accepted: int, k: int, fast_backup: bool = False) -> None:
        (self.backup if fast_backup else self.neural).observe(accepted, k)

    def fanout(self, budget: int, k: int, fast_backup: bool = False) -> list[int]:
        alpha = (self.backup if fast_backup else self.neural).alpha
        return allocate_fanout(budget, alpha, k, self.r)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of one draft forward: fixed + per_row x tokens fed + per_logit x logit rows computed. A
    one-token-per-sequence forward over `rows` sequences computes one logit row each (`step_s`).

    The logit rows are a cost of their own: the LM head and the fp32 logits grow with the vocabulary (at
    128k tokens a small draft spends most of a decode forward there), while a prefill chunk of many tokens
    computes one. `max_rows`: the most logit rows of a measured forward (plans are not extrapolated far
    beyond what was measured, see `plan_predraft`)."""

    fixed_s: float
    per_row_s: float
    per_logit_s: float = 0.0
    max_rows: int | None = field(default=None, compare=False)

    def step_s(self, rows: int) -> float:
        return self.fixed_s + (self.per_row_s + self.per_logit_s) * rows

    def forward_s(self, tokens: int, logits: int) -> float:
        return self.fixed_s + self.per_row_s * tokens + self.per_logit_s * logits

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, float]]) -> StepCostModel:
        """Least squares over measured (rows, seconds) pairs; both terms clamped at >= 0."""
        if not samples:
            raise ValueError("no timing samples")
        n = len(samples)
        mx = sum(x for x, _ in samples) / n
        my = sum(y for _, y in samples) / n
        var = sum((x - mx) ** 2 for x, _ in samples)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in samples) / var) if var else 0.0
        return cls(max(0.0, my - slope * mx), slope)

    @classmethod
    def fit_forwards(cls, samples: Sequence[tuple[int, int, float]]) -> StepCostModel:
        """Non-negative least squares over measured draft forwards (tokens fed, logit rows, seconds).

        Terms the samples cannot tell apart are not guessed in the cheap direction: when every forward had
        about the same size, a fixed cost and a per-row cost explain them equally well, and the model
        without the fixed cost is taken (cost proportional to rows), which never predicts a forward larger
        than those measured to be nearly free; likewise per token over per logit row when the two always
        coincide (one-token forwards only). Measured: at vocabulary 128256 on one core, 16-row forwards
        only gave fixed 8.8 ms + 0.09 ms per row, and the plan's 256-row branch step then took 0.77 s."""
        if not samples:
            raise ValueError("no timing samples")
        xs = [(1.0, float(t), float(lg)) for t, lg, _ in samples]
        ys = [float(y) for _, _, y in samples]
        # active terms (0 fixed, 1 per token, 2 per logit row), in order of preference among equal fits
        subsets = [(1,), (1, 2), (2,), (0, 1), (0, 1, 2), (0, 2), (0,)]
        best, best_res = (0.0, 0.0, 0.0), float("inf")
        scale = sum(y * y for y in ys) or 1.0
        for active in subsets:
            coef = _least_squares([[x[i] for i in active] for x in xs], ys)
            if coef is None or min(coef) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, c in zip(active, coef, strict=True):
                full[i] = c
            res = sum((y - sum(f * xi for f, xi in zip(full, x, strict=True))) ** 2 for x, y in zip(xs, ys, strict=True))
            if res < best_res - 1e-6 * scale:
                best, best_res = tuple(full), res
        return cls(best[0], best[1], best[2], max_rows=max(lg for _, lg, _ in samples))


def _least_squares(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve min |a x - b| by the normal equations (a few columns); None when they are (nearly) singular."""
    m = len(a[0])
    g = [[sum(r[i] * r[j] for r in a) for j in range(m)] + [sum(r[i] * y for r, y in zip(a, b, strict=True))]
         for i in range(m)]
    for c in range(m):
        p = max(range(c, m), key=lambda r: abs(g[r][c]))
        if abs(g[p][c]) <= 1e-9 * max(1.0, max(abs(g[i][i]) for i in range(m))):
            return None
        g[c], g[p] = g[p], g[c]
        for r in range(m):
            if r != c:
                f = g[r][c] / g[c][c]
                g[r] = [v - f * w for v, w in zip(g[r], g[c], strict=True)]
    return [g[i][m] / g[i][i] for i in range(m)]


@dataclass(frozen=True)
class PreDraftPlan:
    branches: int  # M per request; 0: pre-drafting cannot finish in time, do not pre-draft
    steps: int  # draft tokens per branch (K, or fewer when time is short)
    #: modelled P(hit) per request (None: a fixed plan, not modelled); not part of the plan's identity
    hit_rate: float | None = field(default=None, compare=False)


#: Prior of `RankEstimate`: the chance that the best candidate of a depth is the bonus token (each
#: further candidate catching this share of what is left), until lookups have measured it.
TOP1_HIT = 0.6
#: Candidate ranks `RankEstimate` and `OutcomeStats` tell apart (rank >= this counts as "not among them").
#: 32 replayed the same hit rates as 16 at budget 24 on eleven demo-pair traces at T=0.7 and 1 (0.404 both)
#: and widens the pre-draft's rank selection (~1 ms more for 96 rows of a 128k vocabulary on one core).
MAX_RANK = 16


class RankEstimate:
    """Where the real bonus token ranked among a depth's candidates (0 = the best one), as exponentially
    decayed counts over past lookups. `hit_prob(f)` = P(rank < f): the hit rate of a depth given f
    branches, measured instead of modelled (the prior fades like any observation)."""

    def __init__(self, top1: float = TOP1_HIT, prior_weight: float = 4.0, decay: float = 0.97):
        self.decay = decay
        # counts / `_scale`, as in `OutcomeStats`: a decay is one multiplication (every looked-up row observes)
        self._counts = [prior_weight * top1 * (1 - top1) ** r for r in range(MAX_RANK)]
        self._counts.append(prior_weight - sum(self._counts))  # rank >= MAX_RANK
        self._scale = 1.0

    @property
    def counts(self) -> list[float]:
        """Decayed counts per rank 0..MAX_RANK (the last: not among the candidates), the prior included."""
        return [c * self._scale for c in self._counts]

    def observe(self, rank: int) -> None:
        self._scale *= self.decay
        if self._scale < 1e-100:
            self._counts, self._scale = self.counts, 1.0
        self._counts[min(max(rank, 0), MAX_RANK)] += 1.0 / self._scale

    def hit_prob(self, f: int) -> float:
        total = sum(self._counts)  # a ratio: the scale cancels
        return sum(self._counts[: max(0, min(f, MAX_RANK))]) / total if total else 0.0


def expected_hit_rate(fanout: Sequence[int], alpha: float, ranks: RankEstimate | None = None) -> float:
    """P(hit) of a fan-out: sum_j P(a=j) P(rank < f_j), ranks from `ranks` (default: the prior)."""
    ranks = ranks or RankEstimate()
    probs = depth_probs(alpha, len(fanout) - 1)
    return sum(p * ranks.hit_prob(f) for p, f in zip(probs, fanout, strict=True))


def non_increasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-increasing fit of `values` (pool adjacent violators). Candidates are ordered by
    the draft's probability, so a later rank catching more bonus tokens than an earlier one is noise.

    >>> non_increasing([0.5, 0.1, 0.3, 0.0])
    [0.5, 0.2, 0.2, 0.0]
    """
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


#: Observations of one depth's own ranks that weigh as much as the pooled ranks of its kind (a depth seen
#: a few times is not trusted alone; one seen a hundred times speaks for itself). 16 with OutcomeStats'
#: memory of ~100 rounds (decay 0.99) replayed best of {4, 16} x {0.97, 0.99, 0.995} on seven demo-pair
#: traces at T=0.7 and 1, budget 24 (mean hit rate 0.3985 against 0.391 for 4 / 0.97 and 0.384 for the
#: geometric shape; `benchmarks/experiments/predictor_analysis.py`); 4 / 0.97 let sparse depths swing (a depth with three
#: rejections at low ranks took 11 of 24 branches).
POOL_WEIGHT = 16.0


class OutcomeStats:
    """Calibrated outcome statistics of rounds of one temperature: how often each accepted count a occurs
    (per draft count k, a decayed histogram with the geometric shape of the measured acceptance as a prior)
    and, per depth, where the real bonus token ranked among that depth's candidates (decayed counts). Two
    kinds of depth are told apart: a rejection (the bonus follows the residual `max(0, p - q)`) and all
    drafts accepted (the bonus follows the target's own distribution); a depth's own counts are smoothed
    towards the pooled counts of its kind, and its rank probabilities are made non-increasing.

    `allocate` spends a budget branch by branch where the expected hit of the next branch,
    P(a=j) x P(rank = f_j | a=j), is highest: with non-increasing rank probabilities this greedy choice
    maximises the modelled hit rate `hit_rate` over all fan-outs of that budget. Measured on the demo
    pair (budget 24, replayed): a small gain (mean hit rate 0.395 -> 0.404 over eleven traces
    at T=0.7 and 1) where served acceptance departs from the geometric shape (live at T=1, 44 % of the
    rounds reject the first draft where the geometric model with the measured α says 30 %); where the
    shape holds, the exact optimum is within 0.005 of it. What bounds the hit rate at T > 0 is the pair
    (docs/algorithm.md)."""

    def __init__(self, top1: float = TOP1_HIT, prior_weight: float = 16.0, decay: float = 0.99):
        if prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"bad OutcomeStats({top1}, {prior_weight}, {decay})")
        self.decay, self.prior_weight = decay, prior_weight
        prior = [prior_weight * top1 * (1 - top1) ** r for r in range(MAX_RANK)]
        prior.append(prior_weight - sum(prior))  # rank >= MAX_RANK
        # The tables hold counts / `_scale`: decaying every count is one multiplication of `_scale` (the
        # answer observes every looked-up row; decaying every table's counts per row cost ~0.12 ms of a
        # batch-64 answer, measured), an observation adds 1 / `_scale`; `_rescale` folds `_scale` back in before
        # it underflows.
        self._scale = 1.0
        #: per kind ("residual", "all"): rank counts of every depth of that kind (the prior fades)
        self._pooled: dict[str, list[float]] = {"residual": list(prior), "all": list(prior)}
        #: per (kind, depth): rank counts of that depth alone
        self._ranks: dict[tuple[str, int], list[float]] = {}
        #: per draft count k: counts of the accepted count a = 0..k
        self._depths: dict[int, list[float]] = {}

    def _scaled(self, table: dict) -> dict:
        return {key: [c * self._scale for c in counts] for key, counts in table.items()}

    @property
    def pooled(self) -> dict[str, list[float]]:
        """Per kind: decayed rank counts of every depth of that kind, the prior included."""
        return self._scaled(self._pooled)

    @property
    def ranks(self) -> dict[tuple[str, int], list[float]]:
        """Per (kind, depth): decayed rank counts of that depth alone."""
        return self._scaled(self._ranks)

    @property
    def depths(self) -> dict[int, list[float]]:
        """Per draft count k: decayed counts of the accepted count a = 0..k."""
        return self._scaled(self._depths)

    def _rescale(self) -> None:
        for table in (self._pooled, self._ranks, self._depths):
            for key, counts in table.items():
                table[key] = [c * self._scale for c in counts]
        self._scale = 1.0

    def observe(self, accepted: int, k: int, rank: int | None = None) -> None:
        """A round of k drafts whose target accepted `accepted`; `rank`: where its bonus token ranked among
        the candidates of that depth (MAX_RANK or more: not among them; None or < 0: not ranked)."""
        if not 0 <= accepted <= k:
            raise ValueError(f"accepted must lie in 0..{k}, got {accepted}")
        self._scale *= self.decay
        if self._scale < 1e-100:
            self._rescale()
        one = 1.0 / self._scale
        self._depths.setdefault(k, [0.0] * (k + 1))[accepted] += one
        if rank is not None and rank >= 0:
            kind = "all" if accepted == k else "residual"
            r = min(rank, MAX_RANK)
            self._pooled[kind][r] += one
            self._ranks.setdefault((kind, accepted), [0.0] * (MAX_RANK + 1))[r] += one

    def depth_probs(self, k: int, alpha: float) -> list[float]:
        """P(a=j), j = 0..k: the measured histogram of k-draft rounds, the geometric shape of `alpha` as a
        prior worth `prior_weight` rounds."""
        counts = [c * self._scale for c in self._depths.get(k, [0.0] * (k + 1))]
        total = sum(counts) + self.prior_weight
        return [(c + self.prior_weight * g) / total for c, g in zip(counts, depth_probs(alpha, k), strict=True)]

    def rank_probs(self, j: int, k: int) -> list[float]:
        """P(rank = r | a = j) for r = 0..MAX_RANK-1, non-increasing (the rest: not among the candidates)."""
        kind = "all" if j == k else "residual"
        pooled = self._pooled[kind]  # a ratio: the scale cancels
        pooled_total = sum(pooled)
        own = [c * self._scale for c in self._ranks.get((kind, j)) or [0.0] * (MAX_RANK + 1)]
        total = sum(own) + POOL_WEIGHT
        return non_increasing([(o + POOL_WEIGHT * p / pooled_total) / total
                               for o, p in zip(own[:MAX_RANK], pooled[:MAX_RANK], strict=True)])

    def allocate(self, budget: int, k: int, alpha: float) -> list[int]:
        """Branches per depth 0..k summing to `budget`: each to the depth whose next branch has the highest
        expected hit P(a=j) P(rank = f_j | a=j) (ties: the likelier depth, then the shallower). Past
        MAX_RANK the ranks are unknown: each further rank is taken to catch at most what the last known
        one did, halving rank by rank."""
        if budget < 0 or k < 0:
            raise ValueError(f"need budget >= 0, k >= 0; got {budget}, {k}")
        pa = self.depth_probs(k, alpha)
        ranks = [self.rank_probs(j, k) for j in range(k + 1)]
        tail = [max(0.0, 1.0 - sum(r)) for r in ranks]
        fan = [0] * (k + 1)

        def gain(j: int) -> tuple[float, float, int]:
            f = fan[j]
            if f < MAX_RANK:
                return pa[j] * ranks[j][f], pa[j], -j
            return pa[j] * min(ranks[j][-1], tail[j]) * 0.5 ** (f - MAX_RANK + 1), pa[j], -j

        for _ in range(budget):
            fan[max(range(k + 1), key=gain)] += 1
        return fan

    def hit_rate(self, fanout: Sequence[int], alpha: float) -> float:
        """Modelled P(hit) of a fan-out: sum_j P(a=j) P(rank < f_j | a=j)."""
        k = len(fanout) - 1
        pa = self.depth_probs(k, alpha)
        return sum(p * sum(self.rank_probs(j, k)[: max(0, min(f, MAX_RANK))])
                   for j, (p, f) in enumerate(zip(pa, fanout, strict=True)))


def plan_predraft(verify_s: float, cost: StepCostModel, batch_size: int, k: int, alpha: float,
                  r: float = DEFAULT_R, max_branches: int = 64, ranks: RankEstimate | None = None,
                  max_rows: int | None = None, branch_step_s: Callable[[int], float] | None = None) -> PreDraftPlan:
    """The pre-drafting plan (branches M per request, steps s) that saves the most critical-path draft
    steps: every feasible plan (glue + s steps over batch x M rows within `verify_s`) is scored by
    P(hit | M) x s, since a hit on a branch of s < K tokens still needs K - s steps on the critical path
    and a miss needs K. P(hit | M) comes from the geometric allocation and the measured candidate ranks.

    Worked example (prior ranks, top-1 0.6): steps cost 20 ms + 0.5 ms per row, K=5, alpha=0.7. With
    170 ms to fill, 5 steps fit 19 branches. With 100 ms, 5 steps fit none, 4 steps fit 1 branch (score
    0.18 x 4), 3 steps fit 12 (score ~0.98 x 3): 12 branches of 3 steps. `max_rows` caps the rows of a
    branch step (batch x M), so that a plan is not built on a cost model extrapolated far past its data.
    `branch_step_s(rows)`: what a branch step of `rows` rows forked from the batch's requests takes, where
    measured (`RoundPlanner.branch_step_s`); default `cost.step_s(rows)`, every row costed like a request's.

    >>> plan = plan_predraft(0.170, StepCostModel(0.020, 0.0005), batch_size=1, k=5, alpha=0.7)
    >>> plan.branches, plan.steps, round(plan.hit_rate, 3)
    (19, 5, 0.949)
    >>> plan = plan_predraft(0.100, StepCostModel(0.020, 0.0005), batch_size=1, k=5, alpha=0.7)
    >>> plan.branches, plan.steps
    (12, 3)
    """
    if batch_size < 1 or k < 1 or max_branches < 1:
        raise ValueError(f"need batch_size, k, max_branches >= 1; got {batch_size}, {k}, {max_branches}")
    ranks = ranks or RankEstimate()
    glue_s = cost.step_s(batch_size)
    branch_step_s = branch_step_s or cost.step_s
    hit_rate: dict[int, float] = {}  # P(hit | m branches): the same for every depth tried
    best, best_score = PreDraftPlan(0, 0, 0.0), 0.0
    for steps in range(k, 0, -1):
        for m in range(1, max_branches + 1):
            if glue_s + steps * branch_step_s(batch_size * m) > verify_s or (max_rows and batch_size * m > max_rows):
                break
            if m not in hit_rate:
                hit_rate[m] = expected_hit_rate(allocate_fanout(m, alpha, k, r), alpha, ranks)
            score = hit_rate[m] * steps
            if score > best_score + 1e-9:
                best, best_score = PreDraftPlan(m, steps, hit_rate[m]), score
    return best


def branches_pay_off(hit_rate: float, batch_size: int, k: int, verify_s: float, late_s: float,
                     cost: StepCostModel, alpha: float, tokens_ngram: float, policy: str = "auto") -> bool:
    """Whether a round's branch steps are worth the lateness `late_s` they cause (the answer waits for the
    pre-draft forward in flight): the expected tokens per second of the next step with them (each row hits
    with `hit_rate`, over `verify_s + late_s`) against without them (every row misses), each miss getting
    the per-row backup `backup.choose_draft_now` would give it (`backup.step_rate`). With per-row backups
    a miss in a batch no longer stalls the hits, so at batch > 1 pre-drafting pays at a modest hit rate
    where one miss used to put K draft forwards on every row's path.

    >>> cost = StepCostModel(0.015, 0.001)
    >>> branches_pay_off(0.95, 8, 5, 0.4, 0.04, cost, 0.9, 1.1)
    True
    >>> branches_pay_off(0.5, 4, 5, 0.28, 0.015, cost, 0.7, 1.1, "jit")  # one miss stalls all: no
    False
    >>> branches_pay_off(0.5, 4, 5, 0.28, 0.015, cost, 0.7, 1.1)  # hits answered, misses left to n-gram
    True
    >>> branches_pay_off(0.3, 4, 5, 0.28, 0.015, cost, 0.7, 1.1)  # too few hits either way
    False
    """
    args = (k, alpha, tokens_ngram, 1)
    with_branches = step_rate(batch_size, hit_rate, *args, verify_s + late_s, cost.fixed_s, cost.per_row_s,
                              policy, per_logit_s=cost.per_logit_s)
    without = step_rate(batch_size, 0.0, *args, verify_s, cost.fixed_s, cost.per_row_s, policy,
                        per_logit_s=cost.per_logit_s)
    return with_branches > without
