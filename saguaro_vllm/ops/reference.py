"""Plain-torch references of the saguaro ops: the ground truth the kernels are tested against, and the
fallback where no build is available. Written for clarity (host loops over requests, dense masks per
request), not speed.

Token order used by every op: value descending, then index ascending (so ties go to the lower index).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot // block_size, slot % block_size] = key/value per token; slots < 0 are skipped."""
    block_size = kv_cache.shape[2]
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key.to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value.to(kv_cache.dtype)


def branch_attention(
    query: torch.Tensor,  # [Q, H, D]: one query per branch
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    prefix_lens: torch.Tensor,  # [B]: committed tokens N_r; glue at logical positions N_r .. N_r + K
    owners: torch.Tensor,  # [Q]: request index of each query
    depths: torch.Tensor,  # [Q]: j, sees glue 0..j
    steps: torch.Tensor,  # [Q]: s, sees its own branch slots 0..s (-1: none, a glue query)
    branch_slots: torch.Tensor,  # [Q, S]: physical slots of the branch's tokens
    scale: float,
) -> torch.Tensor:
    """Gather each request's keys (prefix, glue, all its branches' slots), mask, softmax in fp32."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.reshape(2, num_blocks * block_size, num_kv_heads, head_size)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    owners_l = owners.long()
    for r in torch.unique(owners_l).tolist():
        idx = (owners_l == r).nonzero().squeeze(1)
        dep, st = depths[idx].long(), steps[idx].long()
        n_pre = int(prefix_lens[r])
        ctx_len = n_pre + int(dep.max()) + 1
        pos = torch.arange(ctx_len, device=query.device)
        ctx_slots = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
        width = int(st.max()) + 1
        br_slots = branch_slots[idx, :width].long()  # [n, S]
        keys = flat[:, torch.cat([ctx_slots, br_slots.flatten()])].float()  # [2, L + n*S, Hkv, D]
        n = idx.numel()
        sees_ctx = pos[None, :] < (n_pre + dep + 1)[:, None]  # [n, L]
        own_steps = torch.arange(width, device=query.device)[None, :] <= st[:, None]  # [n, S]
        sees_branch = torch.eye(n, dtype=torch.bool, device=query.device)[:, :, None] & own_steps[None, :, :]
        mask = torch.cat([sees_ctx, sees_branch.reshape(n, n * width)], dim=1)
        q = query[idx].float().transpose(0, 1)  # [H, n, D]
        o = F.scaled_dot_product_attention(
            q, keys[0].transpose(0, 1), keys[1].transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[idx] = o.transpose(0, 1).to(query.dtype)
    return out


def select_candidates(
    scores: torch.Tensor,  # [B, K+1, V] logits or probabilities of the glue positions
    drafted: torch.Tensor,  # [B, K]: x_1..x_K
    fanout: torch.Tensor,  # [B, K+1]: f_j per request
    max_fanout: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (request, depth j): the first f_j tokens in order, x_{j+1} excluded for j < K.

    Returns tokens [B, K+1, max_fanout] int64 (-1 beyond f_j) and their scores as float32 (-inf beyond).
    """
    b, k1, vocab = scores.shape
    if bool((fanout < 0).any()) or bool((fanout > max_fanout).any()):
        raise ValueError("fanout entries must lie in 0..max_fanout")
    x = scores.float()
    order = torch.sort(x, dim=-1, descending=True, stable=True).indices  # [B, K+1, V]
    take = min(max_fanout + 1, vocab)
    top = order[..., :take]
    excl = torch.full((b, k1), -1, dtype=torch.long, device=scores.device)
    excl[:, : k1 - 1] = drafted.long()
    is_excl = top == excl[..., None]
    # Output rank i reads top[i] before the excluded token and top[i + 1] from it on.
    shift = is_excl.long().cumsum(-1)
    tokens = torch.full((b, k1, max_fanout + 1), -1, dtype=torch.long, device=scores.device)
    src = torch.arange(take, device=scores.device).expand(b, k1, take) + shift
    ok = src < take
    tokens[..., :take] = torch.where(ok, top.gather(-1, src.clamp(max=take - 1)), -1)
    tokens = tokens[..., :max_fanout]
    rank = torch.arange(max_fanout, device=scores.device)
    tokens = torch.where(rank < fanout[..., None].long(), tokens, -1)
    values = torch.where(tokens >= 0, x.gather(-1, tokens.clamp(min=0)), float("-inf"))
    return tokens, values


def proposal_probs(
    logits: torch.Tensor,  # [n, V]
    temperature: torch.Tensor,  # [n]; <= 0: greedy (one-hot at the argmax)
    top_k: torch.Tensor,  # [n] int; <= 0 or >= V: off. Tie-inclusive (keeps every z >= the k-th largest)
    top_p: torch.Tensor,  # [n]; >= 1: off. Keeps v iff the mass of tokens with larger z is < top_p
    saguaro_f: torch.Tensor,  # [n] int: F, the number of top tokens (in order) scaled by C
    log_c: torch.Tensor,  # [n] float32: log C, C in [0, 1]
) -> torch.Tensor:
    """The proposal q' [n, V] float32.

    z = logits / T. q = softmax(z) over the tokens kept by top-k then top-p (top-p measured on the top-k
    renormalised distribution). q' = q with the first F tokens (in order) multiplied by C, renormalised; when
    C = 0 and every kept token is among them, q' = q. Greedy rows are one-hot at the argmax.
    """
    n, vocab = logits.shape
    x = logits.float()
    t = temperature.float()
    greedy = ~(t > 0)
    z = x / torch.where(greedy, torch.ones_like(t), t)[:, None]
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    k = top_k.long()
    k = torch.where((k > 0) & (k < vocab), k, vocab)
    kth = torch.where(k < vocab, sorted_z.gather(1, (k - 1)[:, None]).squeeze(1), float("-inf"))
    kept = z >= kth[:, None]
    e = torch.where(kept, torch.exp(z - sorted_z[:, :1]), 0.0)
    p = e / e.sum(-1, keepdim=True)
    # Top-p: mass strictly above each value group, in float64.
    p_sorted = p.gather(1, order).double()
    excl_cum = p_sorted.cumsum(-1) - p_sorted
    first_of_group = torch.searchsorted(-sorted_z, -sorted_z, side="left")
    above = torch.zeros_like(excl_cum).scatter_(1, order, excl_cum.gather(1, first_of_group))
    use_p = (top_p < 1.0)[:, None]
    kept &= ~use_p | (above < top_p.double()[:, None]) | (z == sorted_z[:, :1])
    e = torch.where(kept, e, 0.0)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=z.device).expand(n, vocab))
    f = saguaro_f.long().clamp(0, vocab)
    topf = rank < f[:, None]
    lc = log_c.float()
    lc = torch.where((lc == float("-inf")) & (kept.sum(-1) <= f), 0.0, lc)
    w = torch.where(topf, e * torch.exp(lc)[:, None], e)
    probs = w / w.sum(-1, keepdim=True)
    one_hot = F.one_hot(x.argmax(-1), vocab).float()
    return torch.where(greedy[:, None], one_hot, probs)
