"""The static decode path (static_forward.py) against the dynamic one: same fp32 logits and same KV per
sequence at every bucket edge (rows = bucket - 1, bucket, bucket + 1), with forks sharing prefix blocks and
different context lengths; padding rows touch only the scratch block; no device-to-host transfer; vLLM's
Triton kernel with the metadata graphs are captured with (TRITON_INTERPRET=1); SSD rounds drafting the same;
and on CUDA, graph replays equal to eager runs (skipped without a GPU). Also `BlockRows`, the persistent
table rows both paths read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from saguaro_vllm.frontend.config import SaguaroOptions
from saguaro_vllm.drafter.attention import reference_paged_attention
from saguaro_vllm.drafter.block_rows import BlockRows
from saguaro_vllm.drafter.kv_cache import BlockAllocator, BlockTable, KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from saguaro_vllm.drafter.static_forward import resolve_cuda_graphs
from saguaro_vllm.ops import loader
from saguaro_vllm.ops.branch_attention import decode_attention

from sync_count import CountTransfers

BUCKETS = (1, 2, 4, 8, 16)
BLOCK = 4


@pytest.fixture(scope="module")
def draft_model(tiny_pair):
    torch.manual_seed(0)
    return load_draft_model(tiny_pair[1], dtype=torch.float32, device="cpu")


def _pair(model, attention: str, num_blocks: int = 256):
    """A dynamic and a static runner with the same attention; returns (dynamic, static)."""
    dyn = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK))
    sta = DraftModelRunner(model, KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK), static_buckets=BUCKETS,
                           static_max_len=64)
    assert sta.static is not None and sta.graph_mode == "static" and dyn.graph_mode == "dynamic"
    if attention == "reference":
        for r in (dyn, sta):
            r.fused_decode = False
        sta.static.backend = reference_paged_attention
    else:
        if not dyn.fused_decode:
            pytest.skip("the compiled decode attention is not built here")
        assert sta.static.backend is decode_attention
    return dyn, sta


def _kv(runner: DraftModelRunner, req_id: str) -> torch.Tensor:
    """The request's KV in logical order, all layers: [layers, 2, tokens, heads, dim]."""
    blocks = runner._get(req_id).block_table.blocks
    n = runner.num_computed(req_id)
    return torch.stack([layer[:, blocks].flatten(1, 2)[:, :n] for layer in runner.kv_cache.layers])


def _setup(runners, rng) -> list[str]:
    """Parents of different lengths (partial and full last blocks) and forks sharing their prefix blocks;
    returns 20 sequence ids, forks interleaved with parents."""
    ids = []
    for p, length in enumerate((3, 8, 13, 22)):
        ctx = rng.integers(1, 300, length).tolist()
        for r in runners:
            r.add_request(f"p{p}")
            r.forward([(f"p{p}", ctx, 0)])
        ids.append(f"p{p}")
    for f in range(16):
        parent = ids[f % 4]
        n = runners[0].num_computed(parent) - (f % 3)  # at the end, or 1-2 tokens back (a partial block)
        for r in runners:
            r.fork(parent, f"f{f}", n)
        ids.append(f"f{f}")
    return ids


@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_static_equals_dynamic_at_bucket_edges(draft_model, attention):
    dyn, sta = _pair(draft_model, attention)
    rng = np.random.default_rng(0)
    ids = _setup((dyn, sta), rng)
    edges = sorted({n for b in BUCKETS[1:] for n in (b - 1, b, b + 1)})  # 1..17: 17 exceeds the largest
    for n in edges:
        order = rng.permutation(len(ids))[:n]  # rows in any order, forks beside their parents
        chunks = [(ids[i], [int(rng.integers(1, 300))], dyn.num_computed(ids[i])) for i in order]
        before = sta.static.runs.copy()
        want = dyn.forward(chunks)
        got = sta.forward(chunks)
        bucket = next((b for b in BUCKETS if b >= n), None)
        if bucket is None:  # more rows than the largest bucket: the dynamic path ran
            assert sta.static.runs == before
        else:
            assert sta.static.last_bucket == bucket and sta.static.runs[bucket] == before[bucket] + 1
        torch.testing.assert_close(got, want)
        for i in order:
            assert sta.num_computed(ids[i]) == dyn.num_computed(ids[i])
            torch.testing.assert_close(_kv(sta, ids[i]), _kv(dyn, ids[i]))
    assert set(sta.static.runs) == set(BUCKETS)


def test_padding_rows_write_only_the_scratch_block(draft_model):
    _, sta = _pair(draft_model, "reference")
    rng = np.random.default_rng(1)
    ids = _setup((sta,), rng)[:5]  # 5 rows run as 8: three padding rows
    before = [layer.clone() for layer in sta.kv_cache.layers]
    chunks = [(r, [7], sta.num_computed(r)) for r in ids]
    written = set()
    for r, _, pos in chunks:
        table = sta._get(r).block_table
        sta.reserve(r, 1)
        written.add((table.blocks[pos // BLOCK], pos % BLOCK))
    sta.forward(chunks)
    assert sta.static.last_bucket == 8
    changed = set()
    for old, new in zip(before, sta.kv_cache.layers, strict=True):
        diff = (old != new).flatten(3).any(-1).any(0)  # [blocks, block_size]
        changed |= {tuple(x) for x in diff.nonzero().tolist()}
    scratch = sta.static.scratch_block
    assert (scratch, 0) in changed  # the padding rows' KV went somewhere: to the scratch slot
    assert changed - {(scratch, 0)} == written


@pytest.mark.parametrize("static", [False, True])
def test_one_token_forward_makes_no_device_to_host_transfer(draft_model, static):
    dyn, sta = _pair(draft_model, "fused" if loader.use_compiled(torch.device("cpu")) else "reference")
    runner = sta if static else dyn
    ids = _setup((runner,), np.random.default_rng(2))[:12]
    chunks = [(r, [5], runner.num_computed(r)) for r in ids]
    with CountTransfers() as count:
        runner.forward(chunks)
    assert count.total == 0, count.where
    assert (runner.static.last_bucket == 16) if static else runner.static is None


def test_longer_context_than_the_static_table_runs_dynamically(draft_model):
    _, sta = _pair(draft_model, "reference")
    assert sta.static.max_len == 128  # 64 tokens asked, rounded up to whole 128-position tiles
    sta.add_request("long")
    sta.forward([("long", list(range(1, 129)), 0)])
    sta.forward([("long", [3], 128)])
    assert not sta.static.runs  # position 128 is past the table: dynamic
    sta.add_request("short")
    sta.forward([("short", [1, 2], 0)])
    sta.forward([("short", [3], 2)])
    assert sta.static.runs == {1: 1}


def test_block_rows_follow_every_table_change():
    alloc = BlockAllocator(64)
    copies = []
    table = BlockTable(alloc, 4, lambda s, d: copies.append((s, d)))
    rows = BlockRows(rows=1, width=2)
    a = rows.acquire()
    table.ensure(10)  # 3 blocks: wider than the array
    rows.sync([a], [table])
    assert rows.array[a, :3].tolist() == table.blocks and rows.array.shape[1] >= 3
    child = table.fork(6)  # shares block 0, copies the partial second block
    b = rows.acquire()  # grows the rows
    rows.sync([a, b], [table, child])
    assert rows.array[b, :2].tolist() == child.blocks and rows.array[b, 2:].tolist() == [0] * (rows.array.shape[1] - 2)
    table.ensure(10, write_from=0)  # copy-on-write of the shared block 0: changed in place
    rows.sync([a], [table])
    assert rows.array[a, :3].tolist() == table.blocks and copies
    table.shrink(4)
    rows.sync([a], [table])
    assert rows.array[a].tolist() == [table.blocks[0]] + [0] * (rows.array.shape[1] - 1)
    rows.release(b)
    assert not rows.array[b].any() and rows.acquire() == b


def test_cuda_graphs_setting():
    assert SaguaroOptions().cuda_graphs == "auto"
    assert SaguaroOptions(cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ValueError):
        SaguaroOptions(cuda_graphs="yes")
    assert resolve_cuda_graphs("auto", "cpu") is False and resolve_cuda_graphs("auto", "cuda:1") is True
    assert resolve_cuda_graphs(False, "cuda:0") is False
    with pytest.raises(ValueError, match="CUDA draft device"):
        resolve_cuda_graphs(True, "cpu")


def test_cuda_graphs_on_cpu_runner_is_refused(draft_model):
    with pytest.raises(ValueError, match="CUDA"):
        DraftModelRunner(draft_model, KVCacheConfig(num_blocks=8, block_size=BLOCK), cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_equal_eager_forwards(tiny_pair):
    model = load_draft_model(tiny_pair[1], dtype=torch.float16, device="cuda")
    eager = DraftModelRunner(model, KVCacheConfig(num_blocks=256, block_size=16), static_buckets=BUCKETS)
    graphs = DraftModelRunner(model, KVCacheConfig(num_blocks=256, block_size=16), static_buckets=BUCKETS,
                              cuda_graphs=True)
    if graphs.graph_mode != "cuda-graphs":
        pytest.skip(f"no graph-safe attention here ({graphs.attention_impl})")
    rng = np.random.default_rng(3)
    ids = _setup((eager, graphs), rng)
    for n in (1, 3, 4, 5, 3):  # buckets captured on first use, then replayed
        order = rng.permutation(len(ids))[:n]
        chunks = [(ids[i], [int(rng.integers(1, 300))], eager.num_computed(ids[i])) for i in order]
        torch.testing.assert_close(graphs.forward(chunks), eager.forward(chunks), atol=2e-2, rtol=2e-2)
    assert graphs.static.graphs == [1, 4, 8]
    assert graphs.capture_graphs() > 0 and graphs.static.graphs == list(BUCKETS)  # the rest, at once
    for n in (2, 16, 17, 9):  # replays of graphs captured with padding rows only; 17 rows: eager
        order = rng.permutation(len(ids))[:n]
        chunks = [(ids[i], [int(rng.integers(1, 300))], eager.num_computed(ids[i])) for i in order]
        torch.testing.assert_close(graphs.forward(chunks), eager.forward(chunks), atol=2e-2, rtol=2e-2)
        for i in order:
            torch.testing.assert_close(_kv(graphs, ids[i]), _kv(eager, ids[i]), atol=2e-2, rtol=2e-2)
    assert graphs.static.runs == {1: 1, 2: 1, 4: 3, 8: 1, 16: 2} and graphs.static.graphs == list(BUCKETS)


STATIC_TRITON_SCRIPT = r"""
import json, sys, warnings
import numpy as np, torch, triton, triton.language as tl
import vllm.triton_utils as triton_utils
triton_utils.HAS_TRITON, triton_utils.triton, triton_utils.tl = True, triton, tl
warnings.simplefilter("ignore", RuntimeWarning)
from saguaro_vllm.drafter import vllm_attention
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model.loader import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
from test_static_forward import _kv, _setup

torch.set_num_threads(1)
model = load_draft_model(sys.argv[1], torch.float32, "cpu")
dyn = DraftModelRunner(model, KVCacheConfig(num_blocks=128, block_size=16))
sta = DraftModelRunner(model, KVCacheConfig(num_blocks=128, block_size=16), static_buckets=(1, 2, 4, 8, 128),
                       static_max_len=64)
sta.vllm_backend = sta.static.backend = vllm_attention.UnifiedTritonAttention()
rng = np.random.default_rng(4)
ids = _setup((dyn, sta), rng)
err = 0.0
for n in (3, 4, 5, 8, 20):
    order = rng.permutation(len(ids))[:n]
    chunks = [(ids[i], [int(rng.integers(1, 300))], dyn.num_computed(ids[i])) for i in order]
    err = max(err, (sta.forward(chunks) - dyn.forward(chunks)).abs().max().item())
    err = max(err, max((_kv(sta, ids[i]) - _kv(dyn, ids[i])).abs().max().item() for i in order))
print("RESULT " + json.dumps({"err": err, "runs": dict(sta.static.runs), "max_len": sta.static.max_len,
                              "used_3d": sta.static.backend._scratch is not None}))
"""


def test_static_path_through_vllm_triton_attention(tiny_pair):
    """The metadata a graph is captured with (a full-width block table, `max_seq_len` at the table's reach,
    padding rows on the scratch block) through vLLM's Triton kernel, under TRITON_INTERPRET=1: the dynamic
    reference runner's logits and KV (buckets 4, 8 on its 3D kernel; 128 on its 2D kernel)."""
    from test_vllm_attention import _interpret, _need_triton_and_vllm

    _need_triton_and_vllm()
    r = _interpret(STATIC_TRITON_SCRIPT, tiny_pair[1])
    assert r["runs"] == {"4": 2, "8": 2, "128": 1} and r["max_len"] == 128 and r["used_3d"], r
    assert r["err"] <= 1e-4, r


def _ssd_rounds(model, **runner_kw):
    """Two greedy `mode: async` rounds at batch 5 (pre-draft with 8 branches per row, then half the rows hit
    and half miss): every answer's drafts and row statuses, and the runner."""
    from saguaro_vllm.drafter.ssd_drafter import SSDDrafter
    from saguaro_vllm.shared.transport import RowUpdate, StepRequest

    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=512, block_size=16), **runner_kw)
    drafter = SSDDrafter(runner, vocab_size=model.config.vocab_size, options={"backup": "jit", "fanout_budget": 8})
    rng = np.random.default_rng(5)
    ctx = {f"r{i}": rng.integers(2, 300, 10 + 7 * i).tolist() for i in range(5)}
    first = drafter.step(StepRequest(1, [RowUpdate(r, 0, c, 4) for r, c in ctx.items()], []))
    drafter.answered()
    while drafter.busy:
        drafter.advance()
    rows = []
    for j, (rid, c) in enumerate(ctx.items()):
        cached = {t for d, t in drafter.cache.outcomes(rid) if d == 4}
        bonus = min(cached) if j % 2 == 0 else next(t for t in range(2, 300) if t not in cached)
        rows.append(RowUpdate(rid, len(c), first.drafts[j] + [bonus], 4))
    second = drafter.step(StepRequest(2, rows, []))
    return [first.drafts, second.drafts, second.row_status], runner


def test_ssd_rounds_draft_the_same_through_the_static_path(draft_model):
    """Glue, branch steps over forks, hits adopting branch KV and jit drafts: the same drafts either way."""
    want, dyn = _ssd_rounds(draft_model)
    got, sta = _ssd_rounds(draft_model, static_buckets=(8, 64))
    assert got == want and want[2].count("hit") == 3 and want[2].count("jit") == 2
    assert sta.static.runs[64] == 4 and sta.static.runs[8] >= 4, sta.static.runs  # 4 branch steps; jit steps


@pytest.mark.parametrize("setting", ["auto", False, True])
def test_the_drafter_process_resolves_cuda_graphs_for_its_device(tiny_pair, setting):
    """build_drafter (drafter/server.py) on CPU: `auto` and false give the dynamic path, named in the Ready
    info; true is refused."""
    from saguaro_vllm.drafter.model.loader import read_model_info
    from saguaro_vllm.drafter.server import build_drafter

    cfg = {"draft_path": tiny_pair[1], "device": "cpu", "dtype": "float32",
           "vocab_size": read_model_info(tiny_pair[1]).vocab_size, "num_speculative_tokens": 3,
           "saguaro": {"mode": "sync", "block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 64,
                       "linear": "plain", "cuda_graphs": setting}}
    if setting is True:
        with pytest.raises(ValueError, match="CUDA draft device"):
            build_drafter(cfg)
        return
    drafter, info = build_drafter(cfg)
    assert info["graphs"] == "dynamic" and info["graphs_s"] == 0 and drafter.runner.static is None
