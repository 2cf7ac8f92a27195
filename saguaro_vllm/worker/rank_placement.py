"""This engine's drafter: its data-parallel rank's entry of the placement the front end resolved, and under
vLLM's Ray executor the GPU Ray reserved for it, as this worker sees the GPUs.

The front end resolves every local DP rank's drafter at once (`dp_ranks`, resolve.py), and every engine gets
the same config; each output worker takes its own rank's entry. Its rank is vLLM's local DP rank
(`data_parallel_rank_local`, the index vLLM itself offsets GPUs and OpenMP core lists by), and its metrics
carry the global one (`data_parallel_index`, the `engine` label vLLM's own metrics use).
"""
from __future__ import annotations

import os
from typing import Any

#: Keys of a `dp_ranks` entry that replace the top-level ones (which are DP rank 0's).
RANK_KEYS = ("device", "draft_cores", "target_rank_cores")


def dp_indices(parallel_config: Any) -> tuple[int, int]:
    """(local DP rank, global DP rank) of this engine; (0, 0) without data parallelism."""
    index = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    local = getattr(parallel_config, "data_parallel_rank_local", None)
    return (index if local is None else int(local)), index


def for_dp_rank(cfg: dict, local_rank: int, engine: int) -> dict:
    """`cfg` with its drafter placement replaced by local DP rank `local_rank`'s, labelled `engine`."""
    ranks = cfg.get("dp_ranks") or []
    if not ranks:
        return {**cfg, "engine": engine}
    if local_rank >= len(ranks):
        raise ValueError(
            f"Saguaro: this engine is local data-parallel rank {local_rank}, but the front end placed drafters for "
            f"{len(ranks)} rank(s) (speculative_config.saguaro.devices / --data-parallel-size-local); start every "
            "engine of a node from the same front end, or give one device per local rank."
        )
    entry = ranks[local_rank]
    out = {**cfg, **{k: entry[k] for k in RANK_KEYS}, "engine": engine}
    out["target_cores"] = sorted(sum(entry["target_rank_cores"], []))
    out["saguaro"] = {**cfg["saguaro"], "kv_cache_gb": entry["kv_cache_gb"]}
    return out


def ray_device(reserved: dict, node_id: str, device_control: str | None) -> str:
    """The Ray-reserved GPU as this worker (and the drafter it starts, which inherits its environment) sees
    it. `reserved`: what the executor patch recorded (`ray_drafter`: node and physical GPU); `node_id`: this
    worker's Ray node. A reservation on another node cannot be used by a drafter this worker starts."""
    from saguaro_vllm.frontend.device_placement import visible_index

    if reserved["node_id"] != node_id:
        raise ValueError(
            f"Saguaro: the GPU reserved for the drafter is on Ray node {reserved['node_ip']} ({reserved['node_id']}), "
            f"but the output rank (TP rank 0 of the last pipeline stage), which starts the drafter, runs on node "
            f"{node_id}; set speculative_config.saguaro.ray_node to the output rank's node, or saguaro.device to "
            "'cuda:N' (as that worker sees its GPUs) or 'cpu'."
        )
    return f"cuda:{visible_index(int(reserved['physical_gpu']), device_control)}"


def check_node(ray_node: str, node_id: str, node_ip: str) -> None:
    """An explicit node and device (`ray_node` with `device: cuda:N`): the output worker must run there."""
    if ray_node not in (node_id, node_ip):
        raise ValueError(
            f"Saguaro: speculative_config.saguaro.ray_node is {ray_node!r}, but vLLM's Ray executor put the output "
            f"rank (TP rank 0 of the last pipeline stage), which starts the drafter, on node {node_ip} ({node_id}); "
            "set ray_node to that node, or remove it."
        )


def placed_config(cfg: dict, parallel_config: Any, is_output_rank: bool) -> dict:
    """The config this worker's proposer uses: its DP rank's placement, and, on the output rank under Ray,
    the reserved GPU's visible index (`device: auto`) or the check of an explicit node (`ray_node`)."""
    local, engine = dp_indices(parallel_config)
    out = for_dp_rank(cfg, local, engine)
    ray_node = out.get("saguaro", {}).get("ray_node")
    if not is_output_rank or not (out.get("ray_reserve") or ray_node):
        return out
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    if not out.get("ray_reserve"):
        check_node(ray_node, node_id, ray.util.get_node_ip_address())
        return out
    reserved = out.get("ray_drafter")
    if not reserved:
        raise ValueError("Saguaro: device 'auto' under vLLM's Ray executor needs the GPU bundle reserved when the "
                         "executor starts, and none was recorded (is saguaro-vllm installed where vLLM's engine "
                         "process runs?); set speculative_config.saguaro.device to 'cuda:N' or 'cpu'.")
    out["device"] = ray_device(reserved, node_id, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return out
