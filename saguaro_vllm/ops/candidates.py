"""Candidate bonus tokens from the glue distributions (design: ssd-algorithm.md §3).

At depth j < K the drafted token x_{j+1} is excluded (a rejected token is never the bonus token); at depth K
nothing is. Per request and depth the top f_j tokens are taken (ties to the lower token id).

Example: K = 1, drafted x_1 = 5, fanout [[2, 1]]: depth 0 takes the best two tokens other than 5 from
scores[0, 0], depth 1 the best token of scores[0, 1]; three branches in all, ordered (request, depth, rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro_vllm.ops import loader, reference


@dataclass
class Candidates:
    """The branches of one round, ordered by (request, depth, rank)."""

    tokens: torch.Tensor  # [M] int64: the fork (bonus candidate) token of each branch
    depths: torch.Tensor  # [M] int32: j, accepted drafts this branch assumes
    owners: torch.Tensor  # [M] int32: request index in the batch
    scores: torch.Tensor  # [M] float32: the score the token was ranked by

    @property
    def keys(self) -> list[tuple[int, int, int]]:
        """Speculation-cache keys (request index, depth, token)."""
        return list(zip(self.owners.tolist(), self.depths.tolist(), self.tokens.tolist(), strict=True))


def select_candidates_padded(
    scores: torch.Tensor, drafted: torch.Tensor, fanout: torch.Tensor, max_fanout: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-shape form: tokens [B, K+1, max_fanout] (-1 beyond f_j) and their float32 scores."""
    if max_fanout is None:
        max_fanout = int(fanout.max()) if fanout.numel() else 0
    if loader.use_compiled(scores.device):
        return torch.ops.saguaro.select_candidates(scores, drafted, fanout, max_fanout)
    return reference.select_candidates(scores, drafted, fanout, max_fanout)


def select_candidates(scores: torch.Tensor, drafted: torch.Tensor, fanout: torch.Tensor) -> Candidates:
    """`scores` [B, K+1, V] (logits or probabilities), `drafted` [B, K], `fanout` [B, K+1] -> branches."""
    tokens, values = select_candidates_padded(scores, drafted, fanout)
    b, k1, f = tokens.shape
    valid = tokens >= 0
    owners = torch.arange(b, device=tokens.device, dtype=torch.int32)[:, None, None].expand(b, k1, f)
    depths = torch.arange(k1, device=tokens.device, dtype=torch.int32)[None, :, None].expand(b, k1, f)
    return Candidates(tokens[valid], depths[valid], owners[valid], values[valid])
