"""Online choice of Saguaro sampling's C (`sampling_scale: "auto"`): pure policy, no model.

C < 1 scales the draft's top-F probabilities, which moves the target's residual mass `max(0, p - q')` onto
the tokens the speculation cache pre-drafted (more hits after a rejection) and costs acceptance. Which C
pays depends on the pair, the temperature and what a miss costs, so instead of one swept value each round
of a sampled request draws C from a few arms and the outcome of that round scores the arm:

    tokens per second of arm C  =  E[accepted + 1 | C] / (verify_s + P(miss | C) * miss_s)

`verify_s` is the target's measured verification time and `miss_s` what a miss adds to a round (the
measured answer time of steps with a just-in-time draft minus that of steps that hit). Statistics are kept
per temperature bucket (a request at T=1 teaches nothing about one at T=0.3) and decay with every round
of the bucket, so the choice follows a changing load or pair. Every arm gets `min_rounds` rounds per
bucket; after that the choice is optimistic (UCB): each arm's estimate is raised by `optimism` over the
square root of its decayed round count, so an arm whose estimate rests on few recent rounds is tried again
until it is either known to be worse or turns out best (arms far behind cost few rounds, close ones more). Exactness never depends on the choice: whatever C a
round uses, the proposal sent with its drafts is the one they were sampled from.
"""
from __future__ import annotations

import dataclasses
import math

#: The C values tried. 1 (Saguaro sampling off) is always one of them, so the choice can only lose the
#: exploration rounds' share against a fixed C = 1.
ARMS = (1.0, 0.75, 0.5, 0.25)
#: Rounds every arm gets in a temperature bucket before the best one is chosen.
MIN_ROUNDS = 6
#: Optimism of the choice: an arm's estimate times (1 + OPTIMISM / sqrt(its decayed rounds)).
OPTIMISM = 0.5
#: Decay of every arm's statistics per round of its bucket (a memory of about 1 / (1 - DECAY) rounds).
DECAY = 0.995
#: Width of a temperature bucket.
BUCKET_WIDTH = 0.1


def temperature_bucket(temperature: float) -> int:
    """Bucket index of a temperature: 0.1 wide (0.65-0.75 -> 7), everything from 2.0 up in one."""
    return min(int(round(temperature / BUCKET_WIDTH)), 20)


@dataclasses.dataclass
class ArmStats:
    """Decayed sums of one arm's rounds in one temperature bucket."""

    rounds: int = 0  # rounds observed (not decayed): decides when exploring may stop
    weight: float = 0.0
    tokens: float = 0.0  # accepted + 1 per round
    misses: float = 0.0

    def decay(self, factor: float) -> None:
        self.weight *= factor
        self.tokens *= factor
        self.misses *= factor

    def observe(self, tokens: int, missed: bool) -> None:
        self.rounds += 1
        self.weight += 1.0
        self.tokens += tokens
        self.misses += float(missed)

    @property
    def mean_tokens(self) -> float:
        return self.tokens / self.weight if self.weight else 0.0

    @property
    def miss_rate(self) -> float:
        return self.misses / self.weight if self.weight else 0.0

    def tokens_per_s(self, verify_s: float, miss_s: float) -> float:
        return self.mean_tokens / max(verify_s + self.miss_rate * max(miss_s, 0.0), 1e-9)


class ScaleChoice:
    """Chooses C per round of a sampled request and learns from the round's outcome."""

    def __init__(self, arms: tuple[float, ...] = ARMS, *, min_rounds: int = MIN_ROUNDS, optimism: float = OPTIMISM,
                 decay: float = DECAY):
        if not arms or any(not 0.0 <= c <= 1.0 for c in arms):
            raise ValueError(f"arms must be C values in [0, 1], got {arms}")
        self.arms = tuple(arms)
        self.min_rounds, self.optimism, self.decay = min_rounds, optimism, decay
        self._buckets: dict[int, list[ArmStats]] = {}

    def stats(self, temperature: float) -> dict[float, ArmStats]:
        """The arms' statistics of `temperature`'s bucket (for logs and tests)."""
        return dict(zip(self.arms, self._bucket(temperature), strict=True))

    def observe(self, temperature: float, scale: float, tokens: int, missed: bool) -> None:
        """A round drafted with C = `scale` committed `tokens` (accepted + 1); `missed`: its outcome was not
        in the speculation cache although branches had been pre-drafted for it. Unknown C: ignored."""
        if scale in self.arms:
            stats = self._bucket(temperature)
            for arm in stats:
                arm.decay(self.decay)
            stats[self.arms.index(scale)].observe(tokens, missed)

    def explored(self, temperature: float) -> bool:
        """Every arm has had its `min_rounds` rounds at this temperature (the estimates mean something)."""
        return all(s.rounds >= self.min_rounds for s in self._bucket(temperature))

    def best(self, temperature: float, verify_s: float, miss_s: float) -> float:
        """The arm with the highest estimated tokens per second (ties: the larger C)."""
        stats = self._bucket(temperature)
        ranked = sorted(range(len(self.arms)), key=lambda i: (stats[i].tokens_per_s(verify_s, miss_s),
                                                              self.arms[i]))
        return self.arms[ranked[-1]]

    def choose(self, temperature: float, verify_s: float, miss_s: float) -> float:
        """C for the next round: the least-tried arm while any has fewer than `min_rounds` rounds, then the
        arm with the highest optimistic estimate (ties: the larger C)."""
        stats = self._bucket(temperature)
        least = min(range(len(self.arms)), key=lambda i: (stats[i].rounds, i))
        if stats[least].rounds < self.min_rounds:
            return self.arms[least]

        def optimistic(i: int) -> tuple[float, float]:
            bonus = 1.0 + self.optimism / math.sqrt(max(stats[i].weight, 1e-6))
            return stats[i].tokens_per_s(verify_s, miss_s) * bonus, self.arms[i]

        return self.arms[max(range(len(self.arms)), key=optimistic)]

    def _bucket(self, temperature: float) -> list[ArmStats]:
        key = temperature_bucket(temperature)
        if key not in self._buckets:
            self._buckets[key] = [ArmStats() for _ in self.arms]
        return self._buckets[key]
