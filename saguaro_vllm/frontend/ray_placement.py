"""Which GPU bundle of vLLM's Ray placement group the drafter takes: pure decisions, no Ray.

Under vLLM's Ray executor the drafter is still a child process of the output worker (TP rank 0 of the last
pipeline stage), so its GPU must be on that worker's node, and Ray must never give it to a worker. The
executor patch (`patches/ray_executor.py`) has vLLM create its placement group with one GPU bundle more than
the workers need, then, before any worker starts, asks this module which bundle each rank will get (vLLM's
own order, below) and which spare bundle is on the output rank's node, and holds that bundle's GPU with a
small actor for the engine's lifetime.

vLLM 0.32's two Ray executors order ranks differently (the patch fingerprints both, `compat.RELIED_ON`):
- `RayExecutorV2` (the default): rank r takes entry r of `get_bundles_sorted_by_node` (GPU bundles, the
  driver's node first, then by node id), or of `VLLM_RAY_BUNDLE_INDICES` when set.
- `RayDistributedExecutor` (`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`): one worker per GPU bundle in index order
  (the first W, or `VLLM_RAY_BUNDLE_INDICES`), then ranks re-sorted by worker IP: the driver's IP first, then
  nodes holding fewer workers, then by IP (`_init_workers_ray`).
"""
from __future__ import annotations

import dataclasses

from saguaro_vllm.frontend.config import SaguaroConfigError


@dataclasses.dataclass(frozen=True)
class Bundle:
    """One GPU bundle of a placement group: its index and the node Ray put it on."""

    index: int
    node_id: str
    node_ip: str


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank of TP rank 0 of the last pipeline stage (vLLM: rank = pp_rank x TP + tp_rank)."""
    return (pp_size - 1) * tp_size


def v2_ranks(sorted_bundles: list[Bundle], world: int, user_indices: list[int] | None = None) -> list[Bundle]:
    """RayExecutorV2's bundle of each rank: `sorted_bundles` is `get_bundles_sorted_by_node`'s list."""
    if user_indices:
        by_index = {b.index: b for b in sorted_bundles}
        return [by_index[i] for i in user_indices]
    return sorted_bundles[:world]


def v1_ranks(bundles: list[Bundle], world: int, driver_ip: str, user_indices: list[int] | None = None) -> list[Bundle]:
    """RayDistributedExecutor's bundle of each rank: workers created on GPU bundles in index order (or
    `user_indices`), then re-sorted by (not the driver's IP, workers on that IP, IP), a stable sort.

    >>> b = [Bundle(0, "n1", "10.0.0.2"), Bundle(1, "n0", "10.0.0.1"), Bundle(2, "n1", "10.0.0.2")]
    >>> [x.index for x in v1_ranks(b, 3, "10.0.0.1")]
    [1, 0, 2]
    """
    by_index = {b.index: b for b in bundles}
    created = [by_index[i] for i in user_indices] if user_indices else sorted(bundles, key=lambda b: b.index)[:world]
    counts: dict[str, int] = {}
    for b in created:
        counts[b.node_ip] = counts.get(b.node_ip, 0) + 1
    return sorted(created, key=lambda b: (b.node_ip != driver_ip, counts[b.node_ip], b.node_ip))


def drafter_bundle(all_bundles: list[Bundle], ranks: list[Bundle], out_rank: int, ray_node: str | None = None) -> Bundle:
    """The spare GPU bundle (in no rank's hands) on the output rank's node, lowest index first. `ray_node`
    (the user's, an IP or a node id) must be that node. Errors name the field and the fix."""
    out = ranks[out_rank]
    if ray_node is not None and ray_node not in (out.node_ip, out.node_id):
        raise SaguaroConfigError(
            f"speculative_config.saguaro.ray_node: {ray_node!r}, but vLLM's Ray executor puts the output rank (TP "
            f"rank 0 of the last pipeline stage, rank {out_rank}), which starts the drafter, on node {out.node_ip}; "
            "set ray_node to that node, or remove it."
        )
    taken = {b.index for b in ranks}
    spare = sorted((b for b in all_bundles if b.index not in taken), key=lambda b: b.index)
    here = [b for b in spare if b.node_id == out.node_id]
    if here:
        return here[0]
    elsewhere = f" (spare GPU bundles on other nodes: {sorted({b.node_ip for b in spare})})" if spare else ""
    raise SaguaroConfigError(
        f"speculative_config.saguaro.device: 'auto' needs a spare GPU bundle in vLLM's Ray placement group on node "
        f"{out.node_ip}, where the output rank (TP rank 0 of the last pipeline stage) runs and starts the drafter, "
        f"but the group's {len(all_bundles)} GPU bundle(s) hold {len(ranks)} worker(s) and none is spare there"
        f"{elsewhere}. Free a GPU on that node (Ray then places the group with one there), give the placement group "
        "one GPU bundle more on that node (one you create yourself), or set saguaro.device to 'cuda:N' (as that "
        "worker sees its GPUs: shared with a worker) or 'cpu'."
    )
