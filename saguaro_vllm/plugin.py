"""vLLM `general_plugins` entry point: vLLM calls `register()` once in every process it starts
(front end, engine core, workers). It applies all saguaro-vllm patches, once per process. It never breaks
vLLM: on a vLLM version the patches were not reviewed for it logs one warning and applies none of them
(only `method: "saguaro"` is then refused, naming the supported versions; `saguaro_vllm.patches`).

Set `SAGUARO_VLLM_DISABLE=1` to load vLLM without any of them (used by tests that must show vLLM's own
behaviour).
"""
from __future__ import annotations

import os

_registered = False


def register() -> None:
    global _registered
    if _registered or os.environ.get("SAGUARO_VLLM_DISABLE", "") not in ("", "0"):
        return
    from saguaro_vllm.patches import apply_all

    apply_all()
    _registered = True
