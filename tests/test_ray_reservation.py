"""The Ray reservation on a real local Ray cluster (skipped where Ray is not installed: it is the `ray` extra).

A local cluster declares 3 GPUs (Ray accounts for GPUs by count; no device is touched), and vLLM's CPU platform,
which declares no Ray device key (it cannot run the Ray executor), is given "GPU" for the test: everything else
is real. `reserve_drafter_gpu` has vLLM's own `initialize_ray_cluster` create the placement group with one
bundle more than TP=2 needs, picks the spare bundle from vLLM's own bundle order, and holds its GPU: the
workers' bundles get the other two GPUs, and nothing else can take the drafter's."""
from __future__ import annotations

import types

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "ray_device_key", "GPU")
    ray.init(num_cpus=2, num_gpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0, num_gpus=1)
def _gpu_of_bundle() -> str:
    return str(ray.get_runtime_context().get_accelerator_ids()["GPU"][0])


def test_the_spare_bundle_is_held_for_the_drafter(local_ray):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from saguaro_vllm.patches.ray_executor import reserve_drafter_gpu

    cfg = {"ray_reserve": True, "saguaro": {"ray_node": None}}
    parallel = types.SimpleNamespace(world_size=2, tensor_parallel_size=2, pipeline_parallel_size=1,
                                     placement_group=None, ray_runtime_env=None)
    executor = types.SimpleNamespace(parallel_config=parallel,
                                     vllm_config=types.SimpleNamespace(additional_config={"saguaro": cfg}))
    reserve_drafter_gpu(executor, cfg)
    group = parallel.placement_group
    assert parallel.world_size == 2 and len(group.bundle_specs) == 3  # the workers' 2 and the drafter's
    held = cfg["ray_drafter"]
    assert held["bundle"] == 2 and held["node_id"] == ray.get_runtime_context().get_node_id()

    def in_bundle(i):
        return _gpu_of_bundle.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=i))

    workers = ray.get([in_bundle(0).remote(), in_bundle(1).remote()], timeout=60)
    assert held["physical_gpu"] not in workers and len(set(workers)) == 2
    with pytest.raises(ray.exceptions.GetTimeoutError):  # the drafter's GPU is taken, for anyone in the group
        ray.get(in_bundle(2).remote(), timeout=5)
