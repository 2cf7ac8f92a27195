"""`method: "saguaro"` support: rewrite it to vLLM's `custom_class` proposer hook.

vLLM's `SpeculativeConfig.method` is a closed Literal that forbids unknown keys, so the Saguaro config is
validated and resolved here (front end, before any engine process starts), the method becomes
`custom_class` with our proposer's class path, and the resolved options travel to every process in
`vllm_config.additional_config["saguaro"]`.
"""
from __future__ import annotations

import functools
import logging

from saguaro_vllm.config import ADDITIONAL_CONFIG_KEY, PROPOSER_CLASS, parse_saguaro_config
from saguaro_vllm.patches import vllm_patch

logger = logging.getLogger("vllm.saguaro")


@vllm_patch("vllm.engine.arg_utils:EngineArgs", "create_speculative_config",
            why="accept method 'saguaro' and carry its options to the workers")
def wrap_create_speculative_config(original):
    @functools.wraps(original)
    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, str):
            from saguaro_vllm.config import load_speculative_config_arg

            raw = self.speculative_config = load_speculative_config_arg(raw)
        if not isinstance(raw, dict) or raw.get("method") != "saguaro":
            return original(self, target_model_config, target_parallel_config)
        from vllm.platforms import current_platform

        from saguaro_vllm.resolve import resolve_for_engine

        cfg = parse_saguaro_config(raw)
        resolved = resolve_for_engine(
            cfg,
            target_model_config,
            tp_size=target_parallel_config.tensor_parallel_size,
            is_cpu_platform=current_platform.is_cpu(),
        )
        if self.additional_config is None:
            self.additional_config = {}
        self.additional_config[ADDITIONAL_CONFIG_KEY] = resolved
        logger.info(
            "Saguaro: mode=%s, K=%d, draft=%s on %s%s",
            resolved["saguaro"]["mode"], resolved["num_speculative_tokens"], resolved["draft_path"], resolved["device"],
            f" (cores {resolved['draft_cores']})" if resolved["draft_cores"] else "",
        )
        self.speculative_config = {
            "method": "custom_class",
            "model": PROPOSER_CLASS,
            "num_speculative_tokens": cfg.num_speculative_tokens,
        }
        try:
            return original(self, target_model_config, target_parallel_config)
        finally:
            # Keep the user's view of the arguments: re-creating the config must see 'saguaro' again.
            self.speculative_config = raw

    return create_speculative_config
