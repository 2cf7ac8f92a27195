"""A free, perfect drafter for measuring the speculation ceiling: a vLLM `custom_class` proposer that returns
the target's own greedy continuation, known in advance (benchmark tool, not part of the product).

`benchmarks/ceiling.py` first runs plain vLLM greedily and writes every request's prompt + output token
ids to the JSON file named by `SAGUARO_ORACLE_TOKENS`; this proposer then answers each row with the next K
tokens of the sequence its context is a prefix of, instantly and without any model. At T=0 every draft is
accepted, so each verification yields K + 1 tokens for nothing but the verification's own time: no real
drafter at depth K can beat the resulting tokens per second.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


class OracleProposer:
    def __init__(self, vllm_config: Any):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        with open(os.environ["SAGUARO_ORACLE_TOKENS"]) as f:
            self.sequences = [list(map(int, s)) for s in json.load(f)]

    def load_model(self, *args: Any, **kwargs: Any) -> None:  # no model: the tokens are known
        return None

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            context = token_ids_cpu[i, :n].tolist() if sampled else None
            drafts.append(next((seq[n:n + self.k] for seq in self.sequences
                                if context is not None and len(seq) > n and seq[:n] == context), []))
        return drafts
