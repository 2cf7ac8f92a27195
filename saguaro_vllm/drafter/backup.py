"""What a speculation-cache miss gets (ssd-algorithm.md §5), and the rule that picks it per step.

- `jit`: the draft model drafts K tokens now, on the critical path (as `mode: sync` would).
- `ngram`: copy the tokens that followed the latest earlier occurrence of the context's last n tokens
  (n = 3, 2, 1): nearly free, verified one-hot (exact for any deterministic choice), rarely accepted.

`choose_backup` compares the expected tokens per second of the whole step both ways. Hit rows yield the
same tokens either way; miss rows yield `E(alpha_neural)` with jit and `E_ngram` with n-gram drafts (the
measured mean of tokens per verification of n-gram rows, rows without any n-gram draft counted as the 1
token they yield: an acceptance rate of the drafts there are would overrate them);
jit adds its drafting time to the round, n-gram adds nothing. So jit wins when

    (H + m) E_jit / (T_verify + T_jit(m))  >=  (H E_jit + m E_ngram) / T_verify

with H hit rows, m miss rows. One miss in a large batch stalls every row, which is why n-gram backups take
over at large batch sizes or low hit rates; with no timings yet, jit is chosen.
"""

from __future__ import annotations

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
class BackupInputs:
    hits: int  # rows answered from the speculation cache this step
    misses: int  # rows that need a backup
    k: int
    alpha_neural: float
    tokens_ngram: float  # measured tokens per verification of an n-gram row (>= 1)
    verify_s: float | None  # measured verification time (None: not measured yet)
    jit_s: float | None  # estimated time to draft K tokens for the miss rows now (None: unknown)


def choose_backup(policy: str, x: BackupInputs) -> str:
    """`"jit"` or `"ngram"` for this step's misses under `policy` (auto|jit|ngram); see the module doc."""
    if policy in ("jit", "ngram"):
        return policy
    if policy != "auto":
        raise ValueError(f"unknown backup policy {policy!r}")
    if x.misses == 0 or x.verify_s is None or x.jit_s is None or x.verify_s <= 0:
        return "jit"
    e_jit = expected_tokens(x.alpha_neural, x.k)
    e_ngram = x.tokens_ngram
    with_jit = (x.hits + x.misses) * e_jit / (x.verify_s + x.jit_s)
    with_ngram = (x.hits * e_jit + x.misses * e_ngram) / x.verify_s
    return "jit" if with_jit >= with_ngram else "ngram"
