"""What a speculation-cache miss gets (ssd-algorithm.md §5), and the rule that picks it per row.

- `jit`: the draft model drafts K tokens now, on the critical path (as `mode: sync` would).
- `ngram`: copy the tokens that followed the latest earlier occurrence of the context's last n tokens
  (n = 3, 2, 1): nearly free, verified one-hot (exact for any deterministic choice), rarely accepted;
  a context without any earlier occurrence gets no drafts (the verification yields its bonus token).

`choose_draft_now` decides per row which rows are drafted on the critical path this step: misses (jit
instead of their n-gram drafts) and hits whose branch was cut short (topped up to K instead of sent as they
are). Drafting now is one batched forward per step over the rows still drafting, so its time is
`fixed x steps + per_row x rows fed`, while each row drafted adds its own expected tokens: a row is worth
drafting when the tokens it adds outweigh the time every row of the batch then waits. Candidates are
taken in order of gain per forward row, and the prefix that maximises the step's expected tokens per
second

    (tokens of every row without drafting now + gains of the rows drafted) / (T_verify + T_now(rows))

is drafted. At batch 1 with a fast drafter that is the miss (jit); in a batch of 16 one miss is usually
left to its n-gram drafts so 15 hit rows do not wait. `step_rate` is the same rule in expectation over
how many of a batch's rows miss, which decides whether pre-drafting branches pays at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NGRAM_MAX_N = 3


def ngram_drafts(context: Sequence[int], k: int, max_n: int = NGRAM_MAX_N) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the context's last n tokens,
    for the largest n in max_n..1 that occurs; [] when none does.

    >>> ngram_drafts([1, 2, 3, 4, 1, 2], 3)
    [3, 4, 1]
    >>> ngram_drafts([5, 6, 7], 2)
    []
    """
    size = len(context)
    if k < 1 or size < 2:
        return []
    ctx = list(context)
    for n in range(min(max_n, size - 1), 0, -1):
        tail = ctx[size - n:]
        for start in range(size - n - 1, -1, -1):  # latest occurrence first, never the tail itself
            if ctx[start:start + n] == tail:
                return ctx[start + n:start + n + k]
    return []


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields with k drafts of per-token acceptance alpha: (1 - alpha^(k+1)) / (1 - alpha)."""
    alpha = min(max(alpha, 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class DraftNow:
    """A row that can be drafted on the critical path: a miss (jit) or a hit cut short (`topup`)."""

    row: int
    feed: int  # tokens its first forward feeds (the context the draft model has not seen; 1 for a top-up)
    steps: int  # forwards it needs: its number of drafts (a miss) or the missing tail (a top-up)
    gain: float  # expected tokens its verification gains when drafted now instead of left as it is
    topup: bool = False
    #: logit rows its forwards compute (one per forward it is in: `steps`; more for an aggregate of rows)
    logit_rows: int | None = None

    @property
    def rows_fed(self) -> int:
        return self.feed + self.steps - 1

    @property
    def logits(self) -> int:
        return self.steps if self.logit_rows is None else self.logit_rows


def draft_now_candidates(num_rows: int, misses: dict[int, tuple[int, int, bool]], hit_drafts: dict[int, int],
                         topups: Sequence[tuple[int, int]], served: dict[int, int], alpha: float,
                         e_ngram: float) -> tuple[list[DraftNow], float]:
    """The step's `DraftNow` candidates and the tokens the step yields without any of them: each miss
    (`misses[row] = (tokens fed, drafts wanted, has n-gram drafts)`) gains E(alpha, K) over its n-gram drafts
    (`e_ngram` tokens per verification, or the bonus token alone where there are none); each hit cut short
    (`topups`: (row, drafts to add), `served[row]` drafts it has) gains E(alpha, s + more) - E(alpha, s);
    hits (`hit_drafts[row]`: their drafts) yield E(alpha, s), every other row its bonus token. Shared by
    `SSDDrafter` and the replay (projection/replay.py), so both weigh exactly the same way."""
    candidates, base = [], 0.0
    for i in range(num_rows):
        if i in misses:
            feed, want, has_ngram = misses[i]
            fast = e_ngram if has_ngram else 1.0
            candidates.append(DraftNow(i, feed, want, expected_tokens(alpha, want) - fast))
            base += fast
        else:
            base += expected_tokens(alpha, hit_drafts[i]) if i in hit_drafts else 1.0
    for i, more in topups:
        have = served[i]
        candidates.append(DraftNow(i, 1, more, expected_tokens(alpha, have + more) - expected_tokens(alpha, have),
                                   topup=True))
    return candidates, base


def draft_now_s(rows: Sequence[DraftNow], fixed_s: float, per_row_s: float, per_logit_s: float = 0.0) -> float:
    """Seconds to draft `rows` now in batched forwards: max(steps) forwards, the first feeding every row's
    `feed` tokens, each later one the rows still drafting, each forward one logit row per row in it (the
    linear draft forward cost model, `predictor.StepCostModel`)."""
    if not rows:
        return 0.0
    return (fixed_s * max(r.steps for r in rows) + per_row_s * sum(r.rows_fed for r in rows)
            + per_logit_s * sum(r.logits for r in rows))


def choose_draft_now(candidates: Sequence[DraftNow], base_tokens: float, verify_s: float | None,
                     fixed_s: float | None, per_row_s: float | None, policy: str = "auto",
                     rate: float | None = None, per_logit_s: float = 0.0) -> list[int]:
    """The rows to draft now (see the module doc), sorted. `base_tokens`: the step's expected tokens if
    none is drafted now. With `rate` (the long-run tokens per second of the batch) a set of rows is scored
    by `tokens - rate x seconds`, which maximises the long-run rate; without it, by the step's own tokens
    per second. Policy `jit` drafts every candidate, `ngram` only the top-ups (misses keep their n-gram
    drafts); `auto` drafts every candidate until the timings are measured (`mode: sync`'s choice)."""
    if policy not in ("auto", "jit", "ngram"):
        raise ValueError(f"unknown backup policy {policy!r}")
    if policy == "ngram":
        return sorted(c.row for c in candidates if c.topup)
    if policy == "jit" or verify_s is None or fixed_s is None or per_row_s is None or verify_s <= 0:
        return sorted(c.row for c in candidates)

    def score(tokens: float, seconds: float) -> float:
        return tokens - rate * seconds if rate is not None else tokens / seconds

    def row_s(c: DraftNow) -> float:  # what the row adds to the forwards beyond their fixed cost
        return per_row_s * c.rows_fed + per_logit_s * c.logits

    order = sorted(candidates, key=lambda c: c.gain / max(row_s(c), 1e-12), reverse=True)
    best, best_score = 0, score(base_tokens, verify_s)
    gains, rows_s, steps = 0.0, 0.0, 0
    for m, c in enumerate(order, 1):
        gains += c.gain
        rows_s += row_s(c)
        steps = max(steps, c.steps)
        value = score(base_tokens + gains, verify_s + fixed_s * steps + rows_s)
        if value > best_score:
            best, best_score = m, value
    return sorted(c.row for c in order[:best])


def step_rate(batch: int, hit_rate: float, k: int, alpha: float, tokens_fast: float, feed: int,
              verify_s: float, fixed_s: float, per_row_s: float, policy: str = "auto",
              per_logit_s: float = 0.0) -> float:
    """Long-run tokens per second of steps of `batch` rows that each hit the cache with `hit_rate` (hits
    yield E(alpha, K); misses are drafted now or keep their fast backup's `tokens_fast`, as
    `choose_draft_now` decides at that rate): E[tokens] / E[seconds] over the binomial number of misses,
    the rate found by Dinkelbach's iteration (each pass scores the choices at the previous pass's rate; it
    rises to the best long-run rate in a few passes). `verify_s` includes any lateness the step's branches
    cause.

    >>> round(step_rate(1, 0.0, 5, 0.8, 1.0, 1, 0.1, 0.01, 0.001), 1)  # batch 1, a miss: drafted now
    23.8
    >>> round(step_rate(16, 0.9, 5, 0.8, 1.1, 1, 0.1, 0.01, 0.001), 1)  # few misses in 16: left to n-gram
    548.9
    >>> round(step_rate(16, 0.9, 5, 0.8, 1.1, 1, 0.1, 0.01, 0.001, "jit"), 1)  # every miss drafted now
    396.9
    """
    e_hit = expected_tokens(alpha, k)
    gain = e_hit - tokens_fast
    counts = [(m, math.comb(batch, m) * (1.0 - hit_rate) ** m * hit_rate ** (batch - m)) for m in range(batch + 1)]
    counts = [(m, p) for m, p in counts if p > 0.0]
    rate = None
    for _ in range(4):
        tokens = seconds = 0.0
        for m, p in counts:
            base = (batch - m) * e_hit + m * tokens_fast
            # The m alike misses as one candidate (same forwards, rows fed and gain): drafted all or none.
            misses = [DraftNow(0, m * (feed + k - 1) - (k - 1), k, m * gain, logit_rows=m * k)] if m else []
            drafted = misses if choose_draft_now(misses, base, verify_s, fixed_s, per_row_s, policy, rate,
                                                 per_logit_s) else []
            tokens += p * (base + sum(c.gain for c in drafted))
            seconds += p * (verify_s + draft_now_s(drafted, fixed_s, per_row_s, per_logit_s))
        if rate is not None and tokens / seconds <= rate * (1 + 1e-9):
            break
        rate = tokens / seconds
    return rate
