"""The drafter's attention backends: vLLM's Triton `unified_attention` (the CUDA path of
drafter/vllm_attention.py) against `reference_paged_attention` on CPU through Triton's interpreter, the choice
of backend, and the reference's query chunking (no dense mask or score matrix over a long context).

The Triton checks run in a subprocess with `TRITON_INTERPRET=1` (so it cannot leak into other tests or engine
processes). vLLM's CPU build replaces Triton by a placeholder (its Triton has no CPU backend), so the
subprocess points `vllm.triton_utils` at the real Triton before vLLM's kernel module is imported. bf16 is not
checked there: the interpreter multiplies bf16 bit patterns in `tl.dot` (triton-lang/triton#11584); fp32 and
fp16 are. FlashAttention (`vllm.vllm_flash_attn`) exists only in vLLM's GPU build and is not tested here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from saguaro_vllm.drafter import vllm_attention
from saguaro_vllm.drafter.attention import AttentionMetadata, reference_paged_attention

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (name, dtype, block size, heads, kv heads, head size, sequences). A sequence is (new tokens, KV length) or
# (new tokens, KV length, parent index, shared blocks): a fork whose block table starts with the parent's
# first blocks (its new tokens, like the parent's, lie beyond them).
CASES = [
    ("prefill-mixed", "float32", 16, 4, 2, 64, [(37, 37), (1, 19), (20, 70), (1, 1), (1, 33), (16, 16)]),
    ("prefill-mixed", "float16", 32, 8, 2, 64, [(37, 37), (1, 19), (20, 70), (1, 1), (3, 65)]),
    ("forks", "float32", 32, 4, 1, 64, [(1, 70), (5, 75, 0, 2), (1, 66, 0, 2), (8, 40, 0, 1), (1, 5)]),
    ("forks", "float16", 16, 8, 2, 32, [(2, 50), (1, 49, 0, 3), (6, 60, 0, 3), (1, 17, 0, 1)]),
    ("decode-3d", "float32", 16, 4, 2, 64, [(1, 1), (1, 19), (1, 100), (1, 49, 2, 3)]),
    ("decode-3d", "float16", 32, 8, 2, 128, [(1, 33), (1, 7), (1, 64)]),
    # 17 decode sequences > 128 // 8 kv heads: the 2D kernel even though every sequence has one query
    ("decode-2d", "float16", 16, 16, 8, 32, [(1, 3 + 5 * i) for i in range(17)]),
]
TOL = {"float32": 2e-5, "float16": 2e-3}


def build_case(dtype, block_size, heads, kv_heads, head_size, seqs, seed, device="cpu"):
    """Random cache and one forward's q/k/v (q a strided view of a wider projection, as the model hands it
    over), shuffled block tables; returns (q, k, v, cache, make_meta)."""
    g = torch.Generator().manual_seed(seed)
    bs = block_size
    num_blocks = sum(-(-s[1] // bs) for s in seqs) + 8
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, starts = [], [], [0]
    for s in seqs:
        n, length = s[0], s[1]
        table = list(tables[s[2]][: s[3]]) if len(s) > 2 else []
        assert length - n >= len(table) * bs, "new tokens must lie beyond the shared blocks"
        table += [free.pop() for _ in range(-(-length // bs) - len(table))]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(length - n, length)]
        starts.append(starts[-1] + n)
    width = max(map(len, tables))
    lens = [s[1] for s in seqs]

    def make_meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_query_len=max(s[0] for s in seqs),
            max_seq_len=max(lens))

    cache = torch.randn(2, num_blocks, bs, kv_heads, head_size, generator=g).to(dtype).to(device)
    t, d = starts[-1], head_size
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    return q, k, v, cache, make_meta


def compare(backend, case, seed, device="cpu"):
    """Run `backend` and the reference on copies of one case: the relative error, finiteness, equal caches."""
    _, dtype, bs, h, hkv, d, seqs = case
    q, k, v, cache, make_meta = build_case(getattr(torch, dtype), bs, h, hkv, d, seqs, seed, device=device)
    ours, ref_cache = cache.clone(), cache.clone()
    got = backend(q, k, v, ours, make_meta(), d ** -0.5).float()
    want = reference_paged_attention(q, k, v, ref_cache, make_meta(), d ** -0.5).float()
    err = ((got - want).abs() / (1 + want.abs())).max().item()
    return {"err": err, "finite": bool(got.isfinite().all()), "cache_equal": torch.equal(ours, ref_cache)}

SCRIPT = r"""
import json, sys, warnings
import torch, triton, triton.language as tl
import vllm.triton_utils as triton_utils
# vLLM's CPU build disables Triton (no CPU backend); the interpreter runs it anyway.
triton_utils.HAS_TRITON, triton_utils.triton, triton_utils.tl = True, triton, tl
warnings.simplefilter("ignore", RuntimeWarning)  # numpy's 0/0 in lanes the kernels mask out
from saguaro_vllm.drafter import vllm_attention
from test_vllm_attention import compare
assert vllm_attention._unified_attention() is not None
out = []
for i, case in enumerate(json.loads(sys.argv[1])):
    backend = vllm_attention.UnifiedTritonAttention()
    out.append({**compare(backend, case, seed=i), "used_3d": backend._scratch is not None})
print("RESULT " + json.dumps(out))
"""

RUNNER_SCRIPT = r"""
import json, random, sys, tempfile, warnings
import torch, triton, triton.language as tl
import vllm.triton_utils as triton_utils
triton_utils.HAS_TRITON, triton_utils.triton, triton_utils.tl = True, triton, tl
warnings.simplefilter("ignore", RuntimeWarning)
import transformers
from saguaro_vllm.drafter import vllm_attention
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner

torch.set_num_threads(1)
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=97, max_position_embeddings=512)
path = tempfile.mkdtemp()
transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
model = load_draft_model(path, torch.float32, "cpu")
rng = random.Random(0)
prompts = {"a": [rng.randrange(97) for _ in range(45)], "b": [rng.randrange(97) for _ in range(9)]}
logits = {}
for use_vllm in (True, False):
    runner = DraftModelRunner(model, KVCacheConfig(num_blocks=32, block_size=16), max_tokens_per_seq=20)
    alloc = runner.kv_cache.allocator
    blocks = alloc.allocate(32); random.Random(1).shuffle(blocks); alloc.free(blocks)
    if use_vllm:
        runner.vllm_backend = vllm_attention.UnifiedTritonAttention()
    rows = []
    for rid, p in prompts.items():
        runner.add_request(rid)
    rows.append(runner.forward([(rid, p, 0) for rid, p in prompts.items()], num_logits=3))  # chunked prefill
    runner.fork("a", "a1", 40)  # shares a's first two blocks, copies the third
    runner.fork("a", "a2", 45)
    rows.append(runner.forward([("a", [1], 45), ("a1", [2, 3, 4], 40), ("a2", [5], 45), ("b", [6, 7], 9)],
                               num_logits=[1, 3, 1, 2]))
    for step in range(2):
        rows.append(runner.forward([(r, [step + 8], runner.num_computed(r)) for r in ("a", "a1", "a2", "b")]))
    logits[use_vllm] = torch.cat(rows)
err = (logits[True] - logits[False]).abs().max().item()
print("RESULT " + json.dumps({"err": err, "rows": logits[True].shape[0]}))
"""


def _need_triton_and_vllm() -> None:
    """Skip without Triton or vLLM (checked without importing vLLM into the test process)."""
    for name in ("triton", "vllm"):
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not installed")


def _interpret(script: str, *args: str, timeout: int = 600) -> object:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def results():
    _need_triton_and_vllm()
    return _interpret(SCRIPT, json.dumps(CASES))


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-{CASES[i][1]}-bs{CASES[i][2]}")
def test_unified_triton_attention_matches_reference(results, index):
    r = results[index]
    assert r["finite"] and r["cache_equal"], r
    assert r["err"] <= TOL[CASES[index][1]], r
    assert r["used_3d"] == CASES[index][0].startswith("decode-3d"), r


def test_runner_forwards_through_unified_triton_attention():
    """The runner with vLLM's Triton kernel as its backend (chunked prefill, forks sharing blocks, mixed
    1-token and multi-token rows, decode steps) gives the reference runner's logits."""
    _need_triton_and_vllm()
    pytest.importorskip("transformers")
    r = _interpret(RUNNER_SCRIPT)
    assert r["rows"] == 6 + 7 + 4 + 4
    assert r["err"] <= 1e-4, r


CUDA_TOL = {"float32": 5e-3, "float16": 4e-3, "bfloat16": 3e-2}  # fp32: Triton's tl.dot runs TF32 on GPUs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and vLLM's GPU build)")
@pytest.mark.parametrize("kernel", ["flash", "triton"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_backends_match_reference(kernel, dtype):
    """On a GPU: vLLM's FlashAttention and Triton kernels against the reference, every case, bf16 included.
    (Not run where these tests were written: no GPU.)"""
    if kernel == "flash":
        version = vllm_attention._fa_version(64, 16)
        if version is None or dtype == "float32":
            pytest.skip("no vllm_flash_attn in this vLLM build" if version is None else "FlashAttention: fp16/bf16")
        backend = vllm_attention.FlashAttention(version)
    else:
        if vllm_attention._unified_attention() is None:
            pytest.skip("vLLM's Triton unified_attention unavailable")
        backend = vllm_attention.UnifiedTritonAttention()
    for i, case in enumerate(CASES):
        case = (case[0], dtype, *case[2:])
        if kernel == "flash" and case[2] % 16:
            continue
        r = compare(backend, case, seed=i, device="cuda")
        assert r["finite"] and r["cache_equal"], (case, r)
        assert r["err"] <= CUDA_TOL[dtype], (case, r)


# ---- the choice ----------------------------------------------------------------------------------------------
def test_cpu_keeps_the_drafters_own_kernels(monkeypatch):
    monkeypatch.delenv(vllm_attention.ENV, raising=False)
    name, backend = vllm_attention.select("cpu", torch.float32, 64, 16)
    assert backend is None
    assert name in ("reference", "cpp-decode+reference")
    assert vllm_attention.attention_implementation("cpu", torch.bfloat16, 64, 16) == name


def test_without_vllm_cuda_falls_back_to_the_drafters_own_kernels():
    """Where vLLM is absent, the drafter still imports and chooses its own kernels, even for a CUDA device."""
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        "import torch\n"
        "from saguaro_vllm.drafter.runner import DraftModelRunner\n"
        "from saguaro_vllm.drafter import vllm_attention as va\n"
        "name, backend = va.select('cuda', torch.float16, 64, 16)\n"
        "assert backend is None and 'vllm' not in name, (name, backend)\n"
        "print('RESULT ' + repr(name))\n"
        "print('REASON ' + str(va.unavailable_reason()))\n"
    )
    env = {**os.environ, "SAGUARO_OPS": "reference",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "RESULT 'reference'" in proc.stdout, proc.stderr[-3000:]
    assert "REASON vllm_flash_attn: No module named" in proc.stdout, proc.stdout  # the named fallback reason


def test_choice_on_cuda_names_the_backend(monkeypatch):
    """Selection logic on a CUDA device, with vLLM's kernels stubbed (no GPU here)."""
    monkeypatch.delenv(vllm_attention.ENV, raising=False)
    monkeypatch.setattr(vllm_attention, "_unified_attention", lambda: object())
    monkeypatch.setattr(vllm_attention, "_fa_version", lambda head_size, block_size: 3)
    name, backend = vllm_attention.select("cuda", torch.bfloat16, 128, 16)
    assert name == "vllm-flash-attn-3" and isinstance(backend, vllm_attention.FlashAttention)
    # FlashAttention takes fp16/bf16 and block sizes that are multiples of 16 only
    for dtype, block_size in ((torch.float32, 16), (torch.float16, 8)):
        name, backend = vllm_attention.select("cuda", dtype, 128, block_size)
        assert name == "vllm-triton-unified" and isinstance(backend, vllm_attention.UnifiedTritonAttention)
    monkeypatch.setenv(vllm_attention.ENV, "triton")
    assert vllm_attention.select("cuda", torch.bfloat16, 128, 16)[0] == "vllm-triton-unified"
    monkeypatch.setenv(vllm_attention.ENV, "saguaro")
    assert vllm_attention.select("cuda", torch.bfloat16, 128, 16)[1] is None
    monkeypatch.setenv(vllm_attention.ENV, "flashinfer")
    with pytest.raises(ValueError, match=vllm_attention.ENV):
        vllm_attention.select("cuda", torch.bfloat16, 128, 16)


def test_tiled_block_table_covers_whole_tiles():
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(2, dtype=torch.int64), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([1, 17], dtype=torch.int32),
        block_table=torch.tensor([[5, 0], [3, 4]], dtype=torch.int32),
        query_start_loc_cpu=[0, 1, 2], seq_lens_cpu=[1, 17], max_query_len=1, max_seq_len=17)
    table = vllm_attention._tiled_block_table(meta, 16)
    assert table.shape == (2, 8) and table[:, :2].tolist() == [[5, 0], [3, 4]] and not table[:, 2:].any()
    assert vllm_attention._tiled_block_table(meta, 16) is table  # once per forward, shared by the layers


# ---- the reference's query chunks ------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 7, 64, 256])
def test_chunked_reference_equals_unchunked(chunk):
    """Mixed prefill chunks and decode rows: chunks of queries give what one mask over the whole context gave."""
    seqs = [(300, 300), (1, 40), (45, 90), (2, 2), (1, 1)]
    q, k, v, cache, make_meta = build_case(torch.float32, 16, 4, 2, 32, seqs, seed=0)
    meta = make_meta()
    whole = reference_paged_attention(q, k, v, cache.clone(), meta, 0.17, query_chunk=1 << 30)
    got = reference_paged_attention(q, k, v, cache.clone(), meta, 0.17, query_chunk=chunk)
    torch.testing.assert_close(got, whole, atol=2e-6, rtol=1e-5)
    # and the unchunked path is the plain definition: softmax over the causal prefix of each query
    seq0 = cache.clone()
    reference_paged_attention(q, k, v, seq0, meta, 0.17)
    keys = seq0[:, meta.block_table[0, :19].long()].flatten(1, 2)[:, :300]  # [2, 300, Hkv, D]
    kk, vv = (keys[i].repeat_interleave(2, dim=1) for i in (0, 1))
    scores = torch.einsum("qhd,khd->hqk", q[:300], kk) * 0.17
    scores = scores.masked_fill(~torch.ones(300, 300, dtype=torch.bool).tril(), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    torch.testing.assert_close(got[:300], want, atol=2e-5, rtol=1e-4)


MEMORY_SCRIPT = r"""
import resource, tempfile, torch, transformers
torch.set_num_threads(1)
from saguaro_vllm.drafter.kv_cache import KVCacheConfig
from saguaro_vllm.drafter.model import load_draft_model
from saguaro_vllm.drafter.runner import DraftModelRunner
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=8192)
path = tempfile.mkdtemp()
transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
model = load_draft_model(path, torch.float32, "cpu")
runner = DraftModelRunner(model, KVCacheConfig(num_blocks=300, block_size=16), max_tokens_per_seq=4096)
assert runner.vllm_backend is None
runner.add_request("warm"); runner.forward([("warm", list(range(64)), 0)]); runner.free_request("warm")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
runner.add_request("a")
logits = runner.forward([("a", [(7 * i) % 300 for i in range(4096)], 0)])  # one pass of 4096 queries
assert logits.isfinite().all() and runner.num_computed("a") == 4096
print("RESULT", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_long_prompt_forward_stays_within_memory_bound():
    """A 4096-token single-sequence pass (4 heads): peak RSS grows by well under 256 MB. Before the query
    chunks it grew by about 690 MB here (a [4, 4096, 4096] fp32 score matrix and its softmax per layer)."""
    pytest.importorskip("transformers")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    growth_mb = float(line.split()[1])
    assert growth_mb < 256, f"peak RSS grew by {growth_mb:.0f} MB"
