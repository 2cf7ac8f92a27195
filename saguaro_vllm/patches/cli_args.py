"""`--speculative-config` accepts the path of a JSON file as well as inline JSON.

vLLM 0.32 parses the flag with `json.loads`, so `vllm serve M --speculative-config configs/saguaro.json`
fails; our parser accepts both forms (and gives a clear error for neither).
"""
from __future__ import annotations

import functools

from saguaro_vllm.frontend.config import load_speculative_config_arg
from saguaro_vllm.patches import vllm_patch


@vllm_patch("vllm.engine.arg_utils:EngineArgs", "add_cli_args", static=True,
            why="let --speculative-config take a JSON file path")
def wrap_add_cli_args(original):
    @functools.wraps(original)
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        for action in parser._actions:
            if "--speculative-config" in action.option_strings:
                action.type = load_speculative_config_arg
        return parser

    return add_cli_args
