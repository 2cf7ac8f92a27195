"""Which device each drafter runs on, decided in the front end before any engine starts.

vLLM's multiproc executor gives data-parallel rank d's workers the logical GPUs `[d x W, (d+1) x W)` (W = TP x
PP; `--device-ids` maps logical to physical GPUs, `CUDA_VISIBLE_DEVICES` physical to visible ones: vLLM's
`Worker.init_device`, `get_physical_gpu_ids_for_local_dp_rank`). A drafter is started by its engine's output
worker and inherits that worker's view of the GPUs, so its device is a visible index. `auto` gives each DP
rank's drafter the first GPU after that rank's target GPUs that no target and no other drafter uses; under
vLLM's Ray executor Ray places the workers, and `auto` becomes a GPU bundle Ray reserves for the drafter
(`ray_placement.py`, at executor start), written here as the placeholder "cuda".
"""
from __future__ import annotations

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroConfigError

#: The device of a drafter whose GPU Ray reserves when the executor starts (the worker sets its index).
RAY_RESERVED = "cuda"

RAY_PLACEMENT_FIX = (
    "set saguaro.device to 'auto' (Ray reserves a GPU for the drafter), to a GPU that vLLM's worker of the output "
    "rank (TP rank 0, which starts the drafter) sees, numbered as it sees them (e.g. 'cuda:0' as that worker sees "
    "it: the drafter shares its GPU), or to 'cpu'."
)


def visible_index(physical: int, device_control: str | None) -> int:
    """The visible (torch) index of physical GPU `physical` under `CUDA_VISIBLE_DEVICES=device_control`
    (vLLM's `logical_device_id_to_visible_device_id` without the logical step)."""
    if not device_control:
        return physical
    visible = [int(x) for x in device_control.split(",")]
    if physical not in visible:
        raise SaguaroConfigError(
            f"GPU {physical} is not in CUDA_VISIBLE_DEVICES={device_control}; make it visible to vLLM's workers."
        )
    return visible.index(physical)


def target_gpus(tp_size: int, pp_size: int, dp_size: int, device_ids: list[int] | None = None,
                device_control: str | None = None) -> list[list[int]]:
    """Visible GPU indices of each local DP rank's target workers, as vLLM's multiproc executor assigns them.

    >>> target_gpus(2, 1, 2)
    [[0, 1], [2, 3]]
    >>> target_gpus(1, 1, 2, device_ids=[0, 2])
    [[0], [2]]
    """
    world = tp_size * pp_size
    out = []
    for d in range(dp_size):
        logical = range(d * world, (d + 1) * world)
        out.append([visible_index(device_ids[i], device_control) if device_ids else i for i in logical])
    return out


def _auto(targets: list[list[int]], count: int) -> list[int | None]:
    """Per DP rank, the first GPU after its last target GPU (wrapping around) that no target and no earlier
    rank's drafter uses; None where none is left."""
    taken = {g for gpus in targets for g in gpus}
    out: list[int | None] = []
    for gpus in targets:
        after = max(gpus) + 1
        free = [g % count for g in range(after, after + count) if g % count not in taken]
        out.append(free[0] if free else None)
        if free:
            taken.add(free[0])
    return out


def resolve_devices(cfg: SaguaroConfig, is_cpu_platform: bool, tp_size: int, pp_size: int = 1, dp_size: int = 1,
                    use_ray: bool = False, gpu_count: int | None = None, device_ids: list[int] | None = None,
                    device_control: str | None = None, ray_legacy: bool = False) -> list[str]:
    """Each local DP rank's drafter device (one entry without data parallelism). Collisions (two drafters on
    one GPU) and GPUs that do not exist are errors naming the field and the fix. `gpu_count`: the CUDA devices
    visible (default: torch's count); `device_ids`: vLLM's `--device-ids` (physical GPUs); `device_control`:
    `CUDA_VISIBLE_DEVICES`; `ray_legacy`: vLLM 0.32's older Ray executor (`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`),
    whose start the plugin does not wrap."""
    device, devices = cfg.saguaro.device, cfg.saguaro.devices
    if devices is not None and len(devices) != dp_size:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.devices: gives {len(devices)} device(s) for {dp_size} local data-parallel "
            f"rank(s) (--data-parallel-size{'-local' if dp_size > 1 else ''}); give one per rank, in rank order."
        )
    if cfg.saguaro.ray_node is not None and not use_ray:
        raise SaguaroConfigError(
            "speculative_config.saguaro.ray_node: names a Ray node, but vLLM's Ray executor does not run the workers "
            "(--distributed-executor-backend ray); remove ray_node, or use the Ray executor."
        )
    if is_cpu_platform:
        for field, values in (("device", [device]), ("devices", devices or [])):
            bad = [v for v in values if v not in ("auto", "cpu")]
            if bad:
                raise SaguaroConfigError(
                    f"speculative_config.saguaro.{field}: {bad[0]!r} is not available with the CPU build of vLLM; "
                    "use 'cpu' (or 'auto')."
                )
        return ["cpu"] * dp_size
    if gpu_count is None:
        import torch

        gpu_count = torch.cuda.device_count()
    if use_ray and devices is not None:
        raise SaguaroConfigError(
            "speculative_config.saguaro.devices: places drafters on the GPUs of vLLM's multiproc executor, but Ray "
            "places the workers here; remove devices: device 'auto' has Ray reserve a GPU for each drafter."
        )
    if use_ray and device == "auto":
        if ray_legacy:
            raise SaguaroConfigError(
                "speculative_config.saguaro.device: 'auto' reserves the drafter's GPU when vLLM's Ray executor V2 "
                "starts, but VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 selects the older RayDistributedExecutor (gone in "
                "vLLM 0.33); unset VLLM_USE_RAY_V2_EXECUTOR_BACKEND, or set saguaro.device to 'cuda:N' (GPU N as the "
                "output rank's worker sees them) or 'cpu'."
            )
        return [RAY_RESERVED] * dp_size
    if device != "auto" and dp_size > 1 and device != "cpu":
        raise SaguaroConfigError(
            f"speculative_config.saguaro.device: {device!r} would put the drafters of all {dp_size} data-parallel "
            "ranks on one GPU; give each rank its own with saguaro.devices (one per rank, e.g. "
            f"{[f'cuda:{i}' for i in range(gpu_count - dp_size, gpu_count)] if gpu_count >= dp_size else ['cuda:N']}"
            "), or use 'auto'."
        )
    targets = target_gpus(tp_size, pp_size, dp_size, device_ids, device_control)
    if devices is not None:
        chosen = list(devices)
        field = "devices"
    elif device == "auto":
        found = _auto(targets, gpu_count)
        if None in found:
            used = len({g for gpus in targets for g in gpus})
            if dp_size == 1:
                raise SaguaroConfigError(
                    f"speculative_config.saguaro.device: 'auto' needs a free GPU for the drafter, but the target "
                    f"uses {used} of {gpu_count} GPUs (tensor parallel {tp_size} x pipeline parallel {pp_size}). "
                    "Set device to 'cuda:N' to share a GPU, or free one."
                )
            raise SaguaroConfigError(
                f"speculative_config.saguaro.device: 'auto' needs a free GPU for each of the {dp_size} data-parallel "
                f"ranks' drafters, but their targets use {used} of {gpu_count} GPUs (data parallel {dp_size} x tensor "
                f"parallel {tp_size} x pipeline parallel {pp_size}). Give each rank a device with saguaro.devices "
                "(a target GPU is shared), use 'cpu', or free GPUs."
            )
        chosen = [f"cuda:{g}" for g in found]
        field = "device"
    else:
        chosen = [device] * dp_size
        field = "device"
    for d in chosen:
        if d != "cpu" and int(d[5:]) >= gpu_count:
            raise SaguaroConfigError(
                f"speculative_config.saguaro.{field}: {d!r} does not exist ({gpu_count} CUDA devices visible)"
                + (f"; under the Ray executor {RAY_PLACEMENT_FIX}" if use_ray else ".")
            )
    gpus = [d for d in chosen if d != "cpu"]
    if len(set(gpus)) < len(gpus):
        twice = sorted({d for d in gpus if gpus.count(d) > 1})
        raise SaguaroConfigError(
            f"speculative_config.saguaro.{field}: puts two data-parallel ranks' drafters on {', '.join(twice)}; "
            "give each rank a GPU of its own."
        )
    return chosen


def own_gpu(device: str, targets: list[list[int]]) -> bool:
    """Whether `device` is a GPU no target worker uses (the Ray-reserved GPU is, by construction)."""
    if device == RAY_RESERVED:
        return True
    return device.startswith("cuda:") and int(device[5:]) not in {g for gpus in targets for g in gpus}
