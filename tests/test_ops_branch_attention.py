"""Branch attention over the paged KV cache and the KV write: compiled kernels vs the plain-torch reference,
and every branch vs the same computation run on that branch alone as a plain chain."""

from __future__ import annotations

import math

import pytest
import torch

from saguaro_vllm.drafter.attention import AttentionMetadata, reference_paged_attention
from saguaro_vllm.ops import (
    BranchAttentionMetadata,
    branch_attention,
    loader,
    reference,
    write_kv,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(autouse=True, scope="module")
def compiled_ops():
    for dev in DEVICES:
        impl = loader.implementation(dev)
        assert impl != "reference", f"compiled ops not active on {dev}: {loader.status().error}"


def make_case(batch, branches, prefix_lens, block_size, K, heads, kv_heads, head_size, dtype, device, seed,
              noncontig=False):
    """A random multi-branch step: shuffled block tables, prefix + glue in the paged region, branch tokens in
    scratch slots of other random blocks, random (depth, step) per branch."""
    g = torch.Generator().manual_seed(seed)
    pre = [prefix_lens[i % len(prefix_lens)] for i in range(batch)]
    per_req = [math.ceil((n + K + 1) / block_size) for n in pre]
    num_q = batch * branches
    scratch_blocks = math.ceil(num_q * K / block_size)
    num_blocks = sum(per_req) + scratch_blocks + 3
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(per_req) + 2
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    used = 0
    for r, nb in enumerate(per_req):
        tables[r, :nb] = perm[used : used + nb].int()
        used += nb
    scratch = perm[used : used + scratch_blocks]
    scratch_slots = (scratch[:, None] * block_size + torch.arange(block_size)).flatten()
    scratch_slots = scratch_slots[torch.randperm(scratch_slots.numel(), generator=g)][: num_q * K]
    branch_slots = scratch_slots.view(num_q, K).long()
    owners = torch.arange(batch, dtype=torch.int32).repeat_interleave(branches)
    owners = owners[torch.randperm(num_q, generator=g)]  # queries of a request need not be adjacent
    depths = torch.randint(0, K + 1, (num_q,), generator=g, dtype=torch.int32)
    steps = torch.randint(-1, K, (num_q,), generator=g, dtype=torch.int32)  # -1: a glue query
    shape = (2, num_blocks, block_size, kv_heads, head_size + (16 if noncontig else 0))
    cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(num_q, heads + (3 if noncontig else 0), head_size, generator=g).to(dtype)
    if noncontig:
        cache = cache[..., :head_size]
        q = q[:, 2 : 2 + heads]
        tables = torch.cat([tables, tables], dim=1)[:, ::2]  # strided view, same values
    to = dict(device=device)
    return dict(query=q.to(**to), kv_cache=cache.to(**to), block_tables=tables.to(**to),
                prefix_lens=torch.tensor(pre, dtype=torch.int32, device=device), owners=owners.to(**to),
                depths=depths.to(**to), steps=steps.to(**to), branch_slots=branch_slots.to(**to),
                scale=head_size**-0.5)


# Sampled combinations of the shapes (not the full product): (batch, branches, prefix lengths,
# block size, K, heads, kv heads, head size, dtype).
CASES = [
    (1, 1, [1], 16, 1, 4, 4, 64, torch.float32),
    (3, 7, [19, 1, 257], 32, 5, 8, 2, 64, torch.bfloat16),
    (16, 24, [257, 19, 1, 1000], 16, 4, 8, 1, 64, torch.float16),
    (3, 24, [1000, 19, 257], 32, 5, 16, 2, 128, torch.float32),
    (1, 7, [1000], 16, 3, 32, 8, 64, torch.bfloat16),
    (16, 1, [19, 257], 32, 2, 4, 2, 128, torch.float32),
    (3, 7, [257], 16, 6, 8, 8, 128, torch.float16),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}-m{c[1]}-n{max(c[2])}-bs{c[3]}-K{c[4]}-h{c[5]}/{c[6]}x{c[7]}-{str(c[8])[6:]}")
def test_matches_reference(case, device):
    batch, branches, pre, bs, K, H, Hkv, D, dtype = case
    args = make_case(batch, branches, pre, bs, K, H, Hkv, D, dtype, device, seed=CASES.index(case))
    out = branch_attention(**args)
    ref = reference.branch_attention(**args)
    assert out.dtype == dtype and out.shape == args["query"].shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype, device):
    args = make_case(3, 7, [19, 257, 1], 16, 4, 8, 2, 64, dtype, device, seed=7, noncontig=True)
    assert not args["query"].is_contiguous() and not args["kv_cache"].is_contiguous()
    out = branch_attention(**args)
    ref = reference.branch_attention(**args)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference(dtype, device):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 9, 16, 2, 64, generator=g).to(dtype).to(device)
    kv = torch.randn(10, 2, 2, 64, generator=g).to(device)  # float32 source: the op casts
    k, v = kv[:, 0], kv[:, 1]  # non-contiguous
    slots = torch.randperm(9 * 16, generator=g)[:10].to(device)
    slots[3] = -1  # padding: skipped
    a, b = cache.clone(), cache.clone()
    write_kv(k[:, :, :], v, a, slots)
    reference.write_kv(k, v, b, slots)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_branch_equals_its_chain(dtype, device):
    """One multi-branch step through the drafter's backend interface (write the new token, then attend)
    equals, per branch, causal paged attention over prefix + glue[0..j] + own tokens as one plain chain."""
    K, H, Hkv, D, bs, step = 3, 8, 2, 64, 16, 2
    args = make_case(3, 7, [19, 40, 1], bs, K, H, Hkv, D, dtype, device, seed=11)
    steps = torch.full_like(args["steps"], step)
    meta = BranchAttentionMetadata.build(args["block_tables"], args["prefix_lens"], args["owners"],
                                         args["depths"], steps, args["branch_slots"])
    num_q = steps.numel()
    g = torch.Generator().manual_seed(5)
    k_new = torch.randn(num_q, Hkv, D, generator=g).to(dtype).to(device)
    v_new = torch.randn(num_q, Hkv, D, generator=g).to(dtype).to(device)
    cache = args["kv_cache"].clone()
    out = meta.backend(args["query"], k_new, v_new, cache, meta, args["scale"])

    flat = args["kv_cache"].reshape(2, -1, Hkv, D)
    for i in range(num_q):
        r, j = int(args["owners"][i]), int(args["depths"][i])
        n_pre = int(args["prefix_lens"][r])
        pos = torch.arange(n_pre + j + 1, device=device)
        ctx = args["block_tables"][r].long()[pos // bs] * bs + pos % bs
        chain_slots = torch.cat([ctx, args["branch_slots"][i, :step]])  # earlier own tokens; new one below
        length = chain_slots.numel() + 1
        nblk = math.ceil(length / bs)
        chain = torch.zeros(2, nblk, bs, Hkv, D, dtype=dtype, device=device)
        chain.view(2, nblk * bs, Hkv, D)[:, : length - 1] = flat[:, chain_slots]
        chain_meta = AttentionMetadata(
            slot_mapping=torch.tensor([length - 1], device=device),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([length], dtype=torch.int32, device=device),
            block_table=torch.arange(nblk, dtype=torch.int32, device=device)[None],
            query_start_loc_cpu=[0, 1], seq_lens_cpu=[length], max_query_len=1, max_seq_len=length,
        )
        want = reference_paged_attention(args["query"][i : i + 1], k_new[i : i + 1], v_new[i : i + 1], chain,
                                         chain_meta, args["scale"])
        torch.testing.assert_close(out[i : i + 1], want, **TOL[dtype])


def test_pattern_worked_example():
    """N = 3, K = 2: a depth-1 branch at step 1 sees 7 keys; with all-equal keys its output is the mean of
    exactly those 7 values."""
    bs, D = 4, 64
    cache = torch.zeros(2, 4, bs, 1, D)
    values = torch.arange(16, dtype=torch.float32)
    cache[1] = values.view(4, bs, 1, 1).expand(4, bs, 1, D)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)  # positions 0..3 in block 2, 4..7 in block 0
    branch_slots = torch.tensor([[13, 6]])  # own step-0 token in slot 13, step-1 token in slot 6
    out = branch_attention(torch.ones(1, 1, D), cache, tables, torch.tensor([3], dtype=torch.int32),
                           torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                           torch.tensor([1], dtype=torch.int32), branch_slots, 0.1)
    seen = [8, 9, 10, 11, 0, 13, 6]  # prefix slots 8,9,10; glue b at slot 11, x1 at slot 0; own 13, 6
    torch.testing.assert_close(out[0, 0], torch.full((D,), sum(seen) / 7.0))


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("shape", [
    dict(batch=3, branches=7, prefix_lens=[257, 19, 1], heads=8, kv_heads=2, head_size=64, dtype=torch.float32),
    dict(batch=2, branches=24, prefix_lens=[130, 64], heads=32, kv_heads=8, head_size=128, dtype=torch.bfloat16),
    dict(batch=2, branches=5, prefix_lens=[70, 3], heads=4, kv_heads=1, head_size=72, dtype=torch.float32),
    dict(batch=1, branches=1, prefix_lens=[100], heads=2, kv_heads=2, head_size=64, dtype=torch.float16),
], ids=["gqa4-f32", "many-rows-bf16", "head72-f32", "one-row-f16"])
def test_every_cpu_isa_matches_reference(level, shape):
    """Each prefix kernel build (baseline, AVX2, AVX-512, chosen per CPU) is tested, including items with
    <= 8 rows and head sizes that are not a multiple of 16, where the AVX-512 build hands over to AVX2."""
    ops = torch.ops.saguaro
    active = ops.cpu_isa()
    try:
        if ops.cpu_isa(level) != level:
            pytest.skip(f"this CPU has no {level}")
        dtype = shape["dtype"]
        args = make_case(**{k: v for k, v in shape.items() if k != "dtype"}, block_size=16, K=4, dtype=dtype, device="cpu", seed=21)
        torch.testing.assert_close(branch_attention(**args), reference.branch_attention(**args), **TOL[dtype])
    finally:
        ops.cpu_isa(active)


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512"])
@pytest.mark.parametrize("heads,kv_heads,dtype", [(10, 10, torch.bfloat16), (8, 2, torch.float32),
                                                  (16, 2, torch.float32), (8, 1, torch.float16)])
@pytest.mark.parametrize("queries_per_seq", [1, 3])
def test_forked_sequences_share_prefix_blocks(level, heads, kv_heads, dtype, queries_per_seq):
    """Branches forked from one request share its full blocks (the same block ids) and differ after them;
    the kernel streams the shared keys once for all of them. Covers forks whose tables diverge after one
    block, prefix lengths that differ per fork, a fork with a shorter prefix than the shared blocks, and an
    unrelated request in the same call."""
    ops = torch.ops.saguaro
    active = ops.cpu_isa()
    try:
        if ops.cpu_isa(level) != level:
            pytest.skip(f"this CPU has no {level}")
        g = torch.Generator().manual_seed(5)
        bs, D, K = 16, 64, 3
        free = torch.randperm(200, generator=g).tolist()
        parent = [free.pop() for _ in range(5)]  # 5 full blocks of the request's prefix
        tables, lens = [], []
        for extra in (0, 3, 17, 40):  # forks: the parent's blocks, then their own
            tables.append(parent + [free.pop() for _ in range(3)])
            lens.append(5 * bs + extra)
        tables.append(parent[:1] + [free.pop() for _ in range(7)])  # diverges after one block
        lens.append(3 * bs + 5)
        tables.append(parent[:3] + [free.pop() for _ in range(5)])  # prefix ends inside the shared blocks
        lens.append(2 * bs + 7)
        tables.append([free.pop() for _ in range(8)])  # another request
        lens.append(70)
        B = len(tables)
        owners = torch.arange(B, dtype=torch.int32).repeat_interleave(queries_per_seq)
        nq = owners.numel()
        slots = torch.tensor(free[: -(-nq * K // bs)])
        branch_slots = (slots[:, None] * bs + torch.arange(bs)).flatten()[: nq * K].view(nq, K).long()
        args = dict(
            query=torch.randn(nq, heads, D, generator=g).to(dtype),
            kv_cache=torch.randn(2, 200, bs, kv_heads, D, generator=g).to(dtype),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            prefix_lens=torch.tensor(lens, dtype=torch.int32),
            owners=owners,
            depths=torch.randint(0, K + 1, (nq,), generator=g, dtype=torch.int32),
            steps=torch.randint(-1, K, (nq,), generator=g, dtype=torch.int32),
            branch_slots=branch_slots,
            scale=D**-0.5,
        )
        torch.testing.assert_close(branch_attention(**args), reference.branch_attention(**args), **TOL[dtype])
    finally:
        ops.cpu_isa(active)
