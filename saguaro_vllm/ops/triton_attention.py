"""Branch attention (see branch_attention.py for the pattern) as a Triton kernel, for GPUs.

One program per (query, head): an online-softmax pass over the query's context (committed prefix + glue up
to its depth, read through its request's block table, `BLOCK_N` positions at a time) and then over its own
branch slots `0..step`. fp32 accumulation, any input dtype, GQA by head grouping, no dense mask. It is the
same contract as `torch.ops.saguaro.branch_attention` and is checked against the plain-torch reference on
CPU with `TRITON_INTERPRET=1` (tests/test_ops_triton.py); `benchmarks/device_check.sh` times it against the
CUDA kernel when a GPU is lent. Select it with `SAGUARO_ATTENTION=triton` (CUDA only).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _attend(KV, off, d, valid, stride_kv2, q, scale, m_i, l_i, acc):
        """One online-softmax update with the keys/values at element offsets `off` (masked by `valid`)."""
        k = tl.load(KV + off[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(KV + stride_kv2 + off[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q, 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.sum(p[:, None] * v, 0)[None, :]
        l_i = l_i * alpha + tl.sum(p, 0)
        return m_new, l_i, acc

    @triton.jit
    def _branch_attention_kernel(
        Q, KV, BT, PRE, OWN, DEP, STEP, SLOTS, OUT,
        stride_qq, stride_qh, stride_kv2, stride_kvb, stride_kvs, stride_kvh, stride_bt, stride_slots,
        stride_oq, stride_oh, scale,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
        S_MAX: tl.constexpr,
    ):
        qi = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        d = tl.arange(0, D)
        q = tl.load(Q + qi * stride_qq + h * stride_qh + d).to(tl.float32)[None, :]  # [1, D]
        r = tl.load(OWN + qi).to(tl.int64)
        n_ctx = tl.load(PRE + r) + tl.load(DEP + qi) + 1
        step = tl.load(STEP + qi)
        m_i = tl.zeros([1], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([1, D], dtype=tl.float32)
        for start in range(0, n_ctx, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            valid = pos < n_ctx
            block = tl.load(BT + r * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            off = block * stride_kvb + (pos % BLOCK_SIZE).to(tl.int64) * stride_kvs + kvh * stride_kvh
            m_i, l_i, acc = _attend(KV, off, d, valid, stride_kv2, q, scale, m_i, l_i, acc)
        i = tl.arange(0, S_MAX)
        own = i <= step
        slot = tl.load(SLOTS + qi * stride_slots + i, mask=own, other=0).to(tl.int64)
        off = (slot // BLOCK_SIZE) * stride_kvb + (slot % BLOCK_SIZE) * stride_kvs + kvh * stride_kvh
        m_i, l_i, acc = _attend(KV, off, d, own, stride_kv2, q, scale, m_i, l_i, acc)
        out = acc / l_i[:, None]
        tl.store(OUT + qi * stride_oq + h * stride_oh + d[None, :], out.to(OUT.dtype.element_ty))


def branch_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    owners: torch.Tensor,
    depths: torch.Tensor,
    steps: torch.Tensor,
    branch_slots: torch.Tensor,
    scale: float,
    block_n: int = 64,
) -> torch.Tensor:
    """Same contract as `saguaro_vllm.ops.branch_attention` (query [Q, H, D] -> [Q, H, D])."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    num_q, heads, head_size = query.shape
    _, _, block_size, kv_heads, kv_head_size = kv_cache.shape
    if kv_head_size != head_size or head_size & (head_size - 1):
        raise ValueError(f"head size {head_size} must be a power of two and match the cache's {kv_head_size}")
    if heads % kv_heads or query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("heads must be a multiple of kv heads, and the head dimension contiguous")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_q == 0:
        return out
    slots = branch_slots if branch_slots.shape[1] else branch_slots.new_zeros(num_q, 1)
    s_max = max(1, triton.next_power_of_2(slots.shape[1]))
    bt = block_tables.contiguous()
    _branch_attention_kernel[(num_q, heads)](
        query, kv_cache, bt, prefix_lens.contiguous(), owners.contiguous(), depths.contiguous(),
        steps.contiguous(), slots.contiguous(), out,
        query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), bt.stride(0), slots.contiguous().stride(0), out.stride(0), out.stride(1), float(scale),
        BLOCK_SIZE=block_size, GROUP=heads // kv_heads, D=head_size, BLOCK_N=block_n, S_MAX=s_max,
    )
    return out
