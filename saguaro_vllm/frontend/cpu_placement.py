"""CPU cores for the target's ranks and for each drafter, decided in the front end before any engine starts.

vLLM's CPU backend binds each worker's OpenMP threads to one list of `VLLM_CPU_OMP_THREADS_BIND`
(`0-15|16-31`: one list per local rank in vLLM's order, data-parallel rank, then pipeline stage, then TP rank;
each DP engine takes its slice of `local_world_size` lists). This module gives every target rank its own
cores, every DP rank's drafter its own cores, and refuses overlaps unless `share_cores` allows them, naming
the field and the fix. With one DP rank the split is the one engine's; with several, each DP rank gets a
contiguous share of the cores and is placed within it as one engine would be.
"""
from __future__ import annotations

import dataclasses
import os

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroConfigError, SaguaroOptions


def parse_cores(env_value: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]."""
    cores: list[int] = []
    for part in env_value.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` contiguous slices, sizes differing by at most one (the first slices larger).

    >>> split_cores([0, 1, 2, 3, 4], 2)
    [[0, 1, 2], [3, 4]]
    """
    size, extra = divmod(len(cores), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(cores[at:at + n])
        at += n
    return out


@dataclasses.dataclass
class CpuPlacement:
    """Cores of each DP rank's drafter (`drafts`, local DP rank order) and of each target rank (`ranks`, vLLM's
    local order: DP rank, pipeline stage, TP rank), plus the cores a drafter shares (`share_cores`)."""

    drafts: list[list[int]]
    ranks: list[list[int]]
    shared: list[int]

    @property
    def draft(self) -> list[int]:
        """The first DP rank's drafter cores (the only drafter without data parallelism)."""
        return self.drafts[0]

    @property
    def target(self) -> list[int]:
        return sorted(c for cores in self.ranks for c in cores)

    def dp_ranks(self) -> list[tuple[list[int], list[list[int]]]]:
        """Per local DP rank: (its drafter's cores, its target ranks' core lists)."""
        world = len(self.ranks) // len(self.drafts)
        return [(d, self.ranks[i * world:(i + 1) * world]) for i, d in enumerate(self.drafts)]

    def omp_threads_bind(self) -> str:
        """`VLLM_CPU_OMP_THREADS_BIND` for these ranks: one core list per rank, separated by '|'."""
        return "|".join(",".join(map(str, cores)) for cores in self.ranks)


# The value this plugin last wrote to VLLM_CPU_OMP_THREADS_BIND (an environment variable, so vLLM's engine-core
# and worker processes know it too): a later engine in the same process, perhaps with another TP size, must
# treat it as 'auto', not as the user's own binding.
BIND_SET_BY_US = "SAGUARO_SET_OMP_THREADS_BIND"


def user_bind() -> str:
    """The user's `VLLM_CPU_OMP_THREADS_BIND` ('auto' when unset or when it is the value we set)."""
    value = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return "auto" if value == os.environ.get(BIND_SET_BY_US) else value


def _parallel(dp: int) -> str:
    return "(tensor x pipeline parallel)" if dp == 1 else "(data x tensor x pipeline parallel)"


def _user_rank_cores(bind: str, ranks: int, dp: int) -> list[list[int]] | None:
    """The per-rank core lists of an explicit `VLLM_CPU_OMP_THREADS_BIND` (None for auto / nobind)."""
    if bind in ("auto", "nobind", ""):
        return None
    lists = bind.split("|")
    if len(lists) != ranks:
        raise SaguaroConfigError(
            f"VLLM_CPU_OMP_THREADS_BIND={bind!r} gives {len(lists)} core list(s) but the target has "
            f"{ranks} rank(s) {_parallel(dp)}: give one list per rank separated by '|' "
            "(e.g. '0-15|16-31'), or unset it and use speculative_config.saguaro.target_cores."
        )
    try:
        return [parse_cores(part) for part in lists]
    except ValueError:
        raise SaguaroConfigError(
            f"VLLM_CPU_OMP_THREADS_BIND={bind!r} is not a '|'-separated list of core lists "
            "such as '0-15|16-31'."
        ) from None


def _place_engine(opts: SaguaroOptions, available: list[int], draft: list[int], target: list[int],
                  user_ranks: list[list[int]] | None, world: int, where: str) -> tuple[list[int], list[list[int]]]:
    """One engine's drafter cores and its `world` ranks' core lists within `available` (given `draft`,
    `target` or `user_ranks`, each possibly empty). `where` names the cores in errors."""
    ranks_named = "" if world == 1 else f" for {world} target ranks (tensor x pipeline parallel)"
    draft, target = list(draft), list(target) or sorted(sum(user_ranks or [], []))
    if not draft:
        rest = [c for c in available if c not in target]
        if target:
            draft = rest or available[-1:]
        else:
            draft = available[len(available) - -(-len(available) // (world + 1)):]
    if not target:
        target = [c for c in available if c not in draft]
        if len(target) < world and opts.share_cores:
            target = available
    if len(target) < world:
        if opts.target_cores or user_ranks:
            field = "target_cores"
            why = f"gives {len(target)} core(s){ranks_named}, each rank needs one"
        elif opts.draft_cores:
            field = "draft_cores"
            why = f"leaves {len(target)} core(s){ranks_named}, each rank needs one; give the drafter fewer cores"
        else:
            field = "share_cores"
            why = (f"{world} target rank(s) and the drafter need at least {world + 1} cores; "
                   'set "share_cores": true to let the drafter share cores with the target (slower), '
                   "or use fewer ranks")
        raise SaguaroConfigError(f"speculative_config.saguaro.{field}: {why} ({where}).")
    return sorted(draft), user_ranks or split_cores(sorted(target), world)


def resolve_cpu_placement(cfg: SaguaroConfig, world_size: int = 1, dp_size: int = 1) -> CpuPlacement:
    """Split this machine's cores between `dp_size` local DP ranks of `world_size` target ranks (TP x PP) each,
    and one drafter per DP rank.

    Each rank gets its own cores (`target_cores` split into contiguous slices, or the user's '|'-separated
    `VLLM_CPU_OMP_THREADS_BIND`); each drafter gets its slice of `draft_cores`, by default a rank's share of
    its DP rank's cores (rounded up) from the top. Cores shared between a drafter and a rank, or between two
    drafters, are a config error unless `share_cores` is set.
    """
    opts = cfg.saguaro
    available = sorted(os.sched_getaffinity(0))
    for field, cores in (("draft_cores", opts.draft_cores), ("target_cores", opts.target_cores)):
        bad = [c for c in cores or [] if c not in available]
        if bad:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.{field}: cores {bad} are not available to this process "
                f"(available: {available})."
            )
    user_ranks = _user_rank_cores(user_bind(), world_size * dp_size, dp_size)
    if user_ranks is not None and opts.target_cores and sorted(sum(user_ranks, [])) != sorted(opts.target_cores):
        raise SaguaroConfigError(
            "speculative_config.saguaro.target_cores: differs from VLLM_CPU_OMP_THREADS_BIND="
            f"{os.environ['VLLM_CPU_OMP_THREADS_BIND']!r}; set only one of them."
        )
    drafts, ranks = [], []
    blocks = split_cores(available, dp_size)
    given_target = set(opts.target_cores or sum(user_ranks or [], []))
    # Targets placed by the user: the drafters share the cores left over, in DP rank order.
    rest = [c for c in available if c not in given_target] if given_target and dp_size > 1 else []
    targets = split_cores(sorted(opts.target_cores), dp_size) if opts.target_cores else [[]] * dp_size
    for d in range(dp_size):
        if dp_size == 1:
            block, where = available, f"this process may use {len(available)} cores: {available}"
        else:
            block = blocks[d]
            where = f"data-parallel rank {d} of {dp_size} gets cores {block} of the {len(available)} available"
        own_ranks = user_ranks[d * world_size:(d + 1) * world_size] if user_ranks else None
        draft = _draft_slice(opts, d, dp_size) or (split_cores(rest, dp_size)[d] if len(rest) >= dp_size else [])
        draft, engine_ranks = _place_engine(opts, block, draft, targets[d], own_ranks, world_size, where)
        drafts.append(draft)
        ranks.extend(engine_ranks)
    seen: set[int] = set()
    for cores in ranks:
        if not cores or seen & set(cores):
            raise SaguaroConfigError(
                f"VLLM_CPU_OMP_THREADS_BIND: every target rank needs its own non-empty core list, got {ranks}."
            )
        seen |= set(cores)
    return CpuPlacement(drafts, ranks, _check_shared(opts, drafts, seen, world_size, dp_size, available))


def _draft_slice(opts: SaguaroOptions, d: int, dp_size: int) -> list[int]:
    """DP rank `d`'s share of `draft_cores` (empty: place it by default)."""
    cores = sorted(opts.draft_cores or [])
    if not cores or dp_size == 1:
        return cores
    if len(cores) >= dp_size:
        return split_cores(cores, dp_size)[d]
    if opts.share_cores:
        return cores
    raise SaguaroConfigError(
        f"speculative_config.saguaro.draft_cores: gives {len(cores)} core(s) for the drafters of {dp_size} "
        "data-parallel ranks, each needs one of its own; give at least one core per DP rank (split in DP rank "
        'order), or set "share_cores": true to let the drafters share them (slower).'
    )


def _check_shared(opts: SaguaroOptions, drafts: list[list[int]], target: set[int], world: int, dp: int,
                  available: list[int]) -> list[int]:
    """The cores a drafter shares with a target rank or with another drafter: an error without `share_cores`."""
    shared = set()
    for i, draft in enumerate(drafts):
        shared |= set(draft) & target
        for other in drafts[i + 1:]:
            shared |= set(draft) & set(other)
    if shared and not opts.share_cores:
        ranks_named = "" if world * dp == 1 else f" for {world * dp} target ranks {_parallel(dp)}"
        others = " or another data-parallel rank's drafter cores" if dp > 1 else ""
        raise SaguaroConfigError(
            f"speculative_config.saguaro.draft_cores: cores {sorted(shared)} are also target cores{ranks_named}"
            f"{others} (this process may use {available}); the drafter must run on its own cores: set draft_cores "
            'and target_cores to disjoint lists, or set "share_cores": true to let them share (slower).'
        )
    return sorted(shared)
