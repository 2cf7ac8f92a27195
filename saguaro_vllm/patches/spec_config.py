"""`method: "saguaro"` support: rewrite it to vLLM's `custom_class` proposer hook.

vLLM's `SpeculativeConfig.method` is a closed Literal that forbids unknown keys, so the Saguaro config is
validated and resolved here (front end, before any engine process starts), the method becomes
`custom_class` with our proposer's class path, and the resolved options travel to every process in
`vllm_config.additional_config["saguaro"]`.
"""
from __future__ import annotations

import functools
import logging

from saguaro_vllm.frontend.config import (
    ADDITIONAL_CONFIG_KEY,
    PROPOSER_CLASS,
    SaguaroConfigError,
    parse_speculative_config,
)
from saguaro_vllm.patches import vllm_patch

logger = logging.getLogger("vllm.saguaro")


@vllm_patch("vllm.engine.arg_utils:EngineArgs", "create_speculative_config",
            why="accept method 'saguaro' and carry its options to the workers")
def wrap_create_speculative_config(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, str):
            from saguaro_vllm.frontend.config import load_speculative_config_arg

            raw = self.speculative_config = load_speculative_config_arg(raw)
        if not isinstance(raw, dict) or raw.get("method") != "saguaro":
            return original(self, target_model_config, target_parallel_config)
        check_model_runner()
        from vllm.platforms import current_platform

        from saguaro_vllm.frontend.resolve import resolve_for_engine

        cfg, passed_through = parse_speculative_config(raw)
        if cfg.saguaro.drafter_endpoint:  # a drafter on another host: no local draft to check
            from saguaro_vllm.frontend.remote import resolve_remote

            resolved = resolve_remote(
                cfg, target_model_config, tp_size=target_parallel_config.tensor_parallel_size,
                is_cpu_platform=current_platform.is_cpu(), pp_size=target_parallel_config.pipeline_parallel_size,
                max_num_seqs=_max_num_seqs_bound(self, target_parallel_config))
        else:
            resolved = resolve_for_engine(
                cfg,
                target_model_config,
                tp_size=target_parallel_config.tensor_parallel_size,
                pp_size=target_parallel_config.pipeline_parallel_size,
                is_cpu_platform=current_platform.is_cpu(),
                max_num_seqs=_max_num_seqs_bound(self, target_parallel_config),
                use_ray=_uses_ray(self, target_parallel_config),
                download_dir=getattr(self, "download_dir", None),
                dp_size=_local_dp_size(target_parallel_config),
                device_ids=getattr(target_parallel_config, "assigned_physical_gpu_ids", None),
                ray_legacy=_ray_legacy(),
            )
            _check_lengths(resolved, target_model_config)
        if self.additional_config is None:
            self.additional_config = {}
        self.additional_config[ADDITIONAL_CONFIG_KEY] = resolved
        logger.info(
            "Saguaro: mode=%s, K=%d, draft=%s on %s", resolved["saguaro"]["mode"], resolved["num_speculative_tokens"],
            resolved["draft_path"], _placement_text(resolved),
        )
        self.speculative_config = {
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": cfg.num_speculative_tokens,
            **passed_through,  # vLLM keys that work with custom_class (saguaro_vllm/frontend/vllm_spec_keys.py)
        }
        try:
            return original(self, target_model_config, target_parallel_config)
        finally:
            # Keep the user's view of the arguments: re-creating the config must see 'saguaro' again.
            self.speculative_config = raw

    return create_speculative_config


def check_model_runner() -> None:
    """Refuse Model Runner V2 forced by `VLLM_USE_V2_MODEL_RUNNER=1`: the Saguaro proposer is a `custom_class`
    proposer, which only the V1 runner calls. vLLM's own check (V2 lists `custom_class` as unsupported and
    falls back to V1) is skipped when the variable is set, so nothing else would stop it."""
    from vllm import envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise SaguaroConfigError(
            "speculative_config.method: 'saguaro' runs on vLLM's V1 model runner (it is a custom_class "
            "proposer), but VLLM_USE_V2_MODEL_RUNNER=1 forces Model Runner V2, which has no custom_class "
            "proposers. Unset VLLM_USE_V2_MODEL_RUNNER (vLLM then picks V1 for Saguaro) or set it to 0."
        )


def _max_num_seqs_bound(args, parallel_config) -> int | None:
    """The engine's `max_num_seqs`, or, when the user left it to vLLM (which sets it only after this hook,
    from the usage context this hook does not see), the largest of vLLM's defaults for this platform (doubled
    in `performance_mode: throughput`): an upper bound, so the proposal ring check never passes a ring the
    worker then cannot hold. None: unknown (the ring's cap alone bounds it)."""
    if args.max_num_seqs is not None:
        return int(args.max_num_seqs)
    try:
        world = parallel_config.tensor_parallel_size * parallel_config.pipeline_parallel_size
        defaults = args.get_batch_defaults(world)[1]
        bound = max(defaults.values())
    except Exception:  # a vLLM without these defaults: rely on the cap
        return None
    return bound * (2 if getattr(args, "performance_mode", None) == "throughput" else 1)


def _ray_legacy() -> bool:
    """Whether vLLM 0.32's older Ray executor (RayDistributedExecutor) would run a Ray engine: the patch that
    reserves the drafter's GPU wraps RayExecutorV2, the default (and 0.33's only one)."""
    from vllm import envs

    return not getattr(envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", True)


def _local_dp_size(parallel_config) -> int:
    """The data-parallel ranks whose engines this machine starts (each gets its own drafter)."""
    return int(getattr(parallel_config, "data_parallel_size_local", None)
               or getattr(parallel_config, "data_parallel_size", None) or 1)


def _placement_text(resolved: dict) -> str:
    """Where the drafters go, for the start-up log line: one device (and cores) per data-parallel rank."""
    def one(entry: dict) -> str:
        device = "the GPU Ray reserves" if resolved.get("ray_reserve") else entry["device"]
        return device + (f" (cores {entry['draft_cores']})" if entry["draft_cores"] else "")

    ranks = resolved.get("dp_ranks") or [resolved]  # a remote drafter: one, the endpoint
    if len(ranks) == 1:
        return one(ranks[0])
    return ", ".join(f"DP rank {i}: {one(e)}" for i, e in enumerate(ranks))


def _uses_ray(args, parallel_config) -> bool:
    """Whether vLLM's Ray executor runs the workers (`distributed_executor_backend` "ray", or an executor class
    that uses Ray), as resolved by vLLM's ParallelConfig (which picks Ray by itself inside a Ray placement
    group), else as the engine arguments say."""
    if hasattr(parallel_config, "use_ray"):
        return bool(parallel_config.use_ray)
    backend = getattr(parallel_config, "distributed_executor_backend", None) or args.distributed_executor_backend
    return backend == "ray" or bool(getattr(backend, "uses_ray", False))


def _check_lengths(resolved: dict, target_model_config) -> None:
    """`max_model_len` at most the target's (vLLM's rule for draft lengths); a drafter KV cache that holds
    no block is an error, one smaller than the longest context a warning (those rows go unspeculated)."""
    from saguaro_vllm.drafter.kv_cache import kv_bytes_per_block
    from saguaro_vllm.drafter.model.loader import DTYPES, read_model_info

    target_len = int(target_model_config.max_model_len)
    if resolved.get("max_model_len") and resolved["max_model_len"] > target_len:
        raise SaguaroConfigError(
            f"speculative_config.max_model_len: {resolved['max_model_len']} is more than the target's "
            f"max_model_len ({target_len}); give at most {target_len}, or remove it."
        )
    info = read_model_info(resolved["draft_path"])
    opts = resolved["saguaro"]
    if opts["kv_cache_gb"] == "auto":  # sized by the drafter on its own GPU (at least 1 GiB where that fits)
        return
    per_block = kv_bytes_per_block(info.num_layers, opts["block_size"], info.num_kv_heads, info.head_size,
                                   DTYPES[resolved["dtype"]])
    blocks = int(opts["kv_cache_gb"] * 2**30) // per_block
    if blocks < 1:
        raise SaguaroConfigError(
            f"speculative_config.saguaro.kv_cache_gb: {opts['kv_cache_gb']} GiB holds no KV block of this draft "
            f"({per_block} bytes per block of {opts['block_size']} tokens); give at least "
            f"{per_block / 2**30:.3g}."
        )
    longest = min(target_len, resolved.get("max_model_len") or target_len)
    if blocks * opts["block_size"] < longest:
        logger.warning(
            "Saguaro: the drafter's KV cache (saguaro.kv_cache_gb=%s) holds %d tokens, fewer than max_model_len "
            "(%d): longer contexts go unspeculated, and concurrent requests share those tokens. %.3g GiB holds "
            "one full-length context.", opts["kv_cache_gb"], blocks * opts["block_size"], longest,
            per_block * -(-longest // opts["block_size"]) / 2**30,
        )
