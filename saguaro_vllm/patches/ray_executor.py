"""Under vLLM's Ray executor, reserve the drafter's GPU as a bundle of vLLM's placement group before any
worker starts, on the node of the output rank (TP rank 0 of the last pipeline stage, which starts the drafter).

`RayExecutorV2._init_executor` (the Ray executor of vLLM 0.32 by default and the only one of 0.33) calls
`initialize_ray_cluster`, which creates a placement group of one GPU bundle per worker (or takes the one the
engine runs in), then places rank r on entry r of `get_bundles_sorted_by_node`. The wrapper, when the config
asks for it (`device: auto`, resolved as `ray_reserve`):

1. has vLLM create the group with one GPU bundle more, by calling vLLM's own `initialize_ray_cluster` with
   `world_size + 1` (so Ray initialisation, the bundle specs, the wait and the checks stay vLLM's); the
   executor's own call then finds the group in `parallel_config.placement_group` and uses it;
2. decides from vLLM's bundle order which bundle is spare on the output rank's node
   (`frontend/ray_placement.py`; an engine without one is refused, naming the fix);
3. starts a small actor holding that bundle's GPU for the engine's lifetime (Ray schedules nothing else on
   it) and records the GPU and node it got in the Saguaro config the workers receive (`ray_drafter`); the
   output worker turns it into the drafter's device (`worker/rank_placement.py`).
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from typing import Any

from saguaro_vllm.patches import vllm_patch

logger = logging.getLogger("vllm.saguaro")

EXECUTOR = "vllm.v1.executor.ray_executor_v2:RayExecutorV2"
#: How long the holder actor may take to be scheduled in its (already reserved) bundle.
HOLDER_TIMEOUT_S = 120.0


class DrafterGpuHolder:
    """A Ray actor that holds the drafter's GPU in its bundle (so Ray gives it to no one else) and says which
    GPU and node that is. It does no work; it lives as long as the engine process that owns it."""

    def where(self, device_key: str) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "physical_gpu": str(ctx.get_accelerator_ids()[device_key][0])}


def _saguaro(executor: Any) -> dict | None:
    extra = getattr(executor.vllm_config, "additional_config", None) or {}
    cfg = extra.get("saguaro")
    return cfg if isinstance(cfg, dict) and cfg.get("ray_reserve") else None


def _create_group_with_spare(parallel_config: Any) -> None:
    """vLLM's `initialize_ray_cluster`, made to create a group of `world_size + 1` GPU bundles (a placement group
    the engine already runs in, or one in the config, is used as it is)."""
    from vllm.v1.executor import ray_utils

    kwargs = {}
    if "require_gpu_on_driver" in inspect.signature(ray_utils.initialize_ray_cluster).parameters:
        kwargs["require_gpu_on_driver"] = False  # as RayExecutorV2 calls it in 0.32 (0.33 has no such parameter)
    world = parallel_config.world_size
    in_group = ray_utils.ray.is_initialized() and ray_utils.ray.util.get_current_placement_group() is not None
    if parallel_config.placement_group is None and not in_group:
        parallel_config.world_size = world + 1
    try:
        ray_utils.initialize_ray_cluster(parallel_config, **kwargs)
    finally:
        parallel_config.world_size = world


def _choose_bundle(executor: Any, cfg: dict) -> Any:
    """The spare bundle on the output rank's node, from vLLM's own bundle order (`ray_placement.py`)."""
    import vllm.envs as envs
    from vllm.v1.executor import ray_utils

    from saguaro_vllm.frontend.ray_placement import Bundle, drafter_bundle, output_rank, v2_ranks

    pc = executor.parallel_config
    group = pc.placement_group
    bundles = [Bundle(i, node, ip) for i, node, ip in ray_utils.get_bundles_sorted_by_node(group)]
    indices = [int(i) for i in envs.VLLM_RAY_BUNDLE_INDICES.split(",")] if envs.VLLM_RAY_BUNDLE_INDICES else None
    ranks = v2_ranks(bundles, pc.world_size, indices)
    return drafter_bundle(bundles, ranks, output_rank(pc.tensor_parallel_size, pc.pipeline_parallel_size),
                          cfg["saguaro"].get("ray_node"))


def reserve_drafter_gpu(executor: Any, cfg: dict) -> None:
    """Steps 1-3 of the module docstring; the holder actor is kept on the executor."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from vllm.platforms import current_platform

    _create_group_with_spare(executor.parallel_config)
    bundle = _choose_bundle(executor, cfg)
    key = current_platform.ray_device_key
    resources = {"num_gpus": 1} if key == "GPU" else {"num_gpus": 0, "resources": {key: 1}}
    holder = ray.remote(DrafterGpuHolder).options(
        num_cpus=0, **resources,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=executor.parallel_config.placement_group, placement_group_bundle_index=bundle.index),
        runtime_env={"env_vars": {v: "1" for v in current_platform.ray_noset_device_env_vars}},
    ).remote()
    where = ray.get(holder.where.remote(key), timeout=HOLDER_TIMEOUT_S)
    executor.saguaro_drafter_gpu_holder = holder
    cfg["ray_drafter"] = {"bundle": bundle.index, **where}
    logger.info("Saguaro: GPU %s of node %s (placement group bundle %d) reserved for the drafter",
                where["physical_gpu"], where["node_ip"], bundle.index)


@vllm_patch(EXECUTOR, "_init_executor",
            why="device 'auto' under the Ray executor: the drafter's GPU is a spare bundle of vLLM's placement "
                "group on the output rank's node, reserved before the workers start",
            when=lambda: importlib.util.find_spec("ray") is not None)
def wrap_init_executor(original):
    @functools.wraps(original)
    def _init_executor(self):
        cfg = _saguaro(self)
        if cfg is not None:
            reserve_drafter_gpu(self, cfg)
        return original(self)

    return _init_executor
