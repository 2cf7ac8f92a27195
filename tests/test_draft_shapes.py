"""Draft attention shapes (head size, query heads per KV head) the drafter's kernels cannot run: refused in the
front end where nothing could run them (the GPU kernels, GQA that does not divide), run by the plain-torch
reference on CPU (one log line) instead of failing every step. The limits in `ops/attention_limits.py` are
checked against the kernels' sources."""
from __future__ import annotations

import logging
import pathlib
import re

import pytest
import torch

from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
from saguaro_vllm.ops import attention_limits

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_limits_match_the_kernel_sources():
    cuda_h = (ROOT / "csrc" / "cuda" / "saguaro_cuda.h").read_text()
    assert re.search(rf"kMaxGroup = {attention_limits.CUDA_MAX_GROUP};", cuda_h)
    launch = (ROOT / "csrc" / "cuda" / "kv_attention.cu").read_text()
    assert sorted(int(d) for d in re.findall(r"head_size == (\d+)\)", launch)) == list(attention_limits.CUDA_HEAD_SIZES)
    ops_cuda = (ROOT / "csrc" / "cuda" / "ops_cuda.cpp").read_text()
    assert "(D == 64 || D == 128)" in ops_cuda
    cpu = (ROOT / "csrc" / "attention_cpu.cpp").read_text()
    assert f"kMaxRows = {attention_limits.CPP_MAX_GROUP};" in cpu
    assert f"D % {attention_limits.CPP_HEAD_MULTIPLE} == 0" in cpu
    vllm_attention = ROOT / "saguaro_vllm" / "drafter" / "vllm_attention.py"
    if vllm_attention.exists():
        assert f"head_size >= {attention_limits.VLLM_MIN_HEAD_SIZE}" in vllm_attention.read_text()


@pytest.mark.parametrize(("impl", "heads", "kv_heads", "head", "ok"), [
    ("cpp", 32, 8, 64, True), ("cpp", 4, 4, 20, False), ("cpp", 97, 1, 64, False), ("cpp", 3, 2, 64, False),
    ("cuda", 32, 8, 64, True), ("cuda", 16, 2, 128, True), ("cuda", 8, 8, 96, False), ("cuda", 32, 2, 64, False),
    ("triton", 32, 2, 64, True), ("triton", 4, 4, 96, False),
    ("vllm", 32, 2, 96, True), ("vllm", 4, 4, 8, False),
    ("reference", 5, 5, 20, True), ("reference", 3, 2, 64, False),
])
def test_unsupported(impl, heads, kv_heads, head, ok):
    assert (attention_limits.unsupported(impl, heads, kv_heads, head) is None) == ok


# ---- the drafter runs an odd head size on CPU -----------------------------------------------------------------
def test_cpu_attention_falls_back_to_the_reference_once_logged(caplog):
    import importlib

    from saguaro_vllm.ops import branch_attention, loader, reference

    ba_module = importlib.import_module("saguaro_vllm.ops.branch_attention")

    if not loader.use_compiled("cpu"):
        pytest.skip(f"compiled CPU ops not active: {loader.status().error}")
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = 4, 2, 20, 16
    cache = torch.randn(2, 6, bs, Hkv, D, generator=g)
    q = torch.randn(3, H, D, generator=g)
    args = dict(kv_cache=cache, block_tables=torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
                prefix_lens=torch.tensor([5, 17, 30], dtype=torch.int32),
                owners=torch.arange(3, dtype=torch.int32), depths=torch.zeros(3, dtype=torch.int32),
                steps=torch.full((3,), -1, dtype=torch.int32), branch_slots=torch.zeros(3, 1, dtype=torch.int64),
                scale=D**-0.5)
    with pytest.raises(RuntimeError, match="multiple of 8"):  # what every step used to hit
        torch.ops.saguaro.branch_attention(q, *list(args.values())[:-1], float(args["scale"]))
    ba_module._fallbacks.clear()
    with caplog.at_level(logging.WARNING, logger="saguaro_vllm.ops"):
        out = branch_attention(q, **args)
        branch_attention(q, **args)
    torch.testing.assert_close(out, reference.branch_attention(q, **args))
    lines = [r.getMessage() for r in caplog.records if "cannot run this draft" in r.getMessage()]
    assert len(lines) == 1 and "head size 20 is not a multiple of 8" in lines[0] and "reference" in lines[0]


def _draft(tmp_path, tiny_pair, name, **shape) -> str:
    """A random tiny Llama draft with the tiny pair's tokenizer and the attention `shape` given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from saguaro_vllm.drafter.model.loader import read_model_info

    out = tmp_path / name
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((pathlib.Path(tiny_pair[1]) / f).read_bytes())
    settings = dict(vocab_size=read_model_info(tiny_pair[0]).vocab_size, hidden_size=128, intermediate_size=256,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                    max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                    torch_dtype="float32")
    torch.manual_seed(5)
    LlamaForCausalLM(LlamaConfig(**{**settings, **shape})).save_pretrained(out, safe_serialization=True)
    return str(out)


def test_a_cpu_drafter_drafts_with_a_head_size_its_kernel_cannot_run(tmp_path, tiny_pair, caplog):
    from saguaro_vllm.drafter.model.loader import read_model_info
    from saguaro_vllm.drafter.server import build_drafter
    from saguaro_vllm.shared.transport import RowUpdate, SamplingSpec, StepRequest

    draft = _draft(tmp_path, tiny_pair, "head20", head_dim=20)
    cfg = {"draft_path": draft, "device": "cpu", "dtype": "float32", "vocab_size": read_model_info(draft).vocab_size,
           "num_speculative_tokens": 3,
           "saguaro": {"mode": "sync", "block_size": 16, "kv_cache_gb": 0.01, "max_tokens_per_forward": 64,
                       "linear": "plain"}}
    drafter, info = build_drafter(cfg)
    # a prefill, then one-token decode passes (the compiled decode attention's path) for each draft token
    rows = [RowUpdate("a", 0, [5, 6, 7], 3, SamplingSpec()), RowUpdate("b", 0, [9, 4], 3, SamplingSpec())]
    for step, req_rows in enumerate([rows, [RowUpdate("a", 3, [], 3), RowUpdate("b", 2, [], 3)]], 1):
        resp = drafter.step(StepRequest(step, req_rows, []))
        assert resp.error is None and [len(d) for d in resp.drafts] == [3, 3], resp


# ---- the front end -------------------------------------------------------------------------------------------
def _resolve(draft, target, **opts):
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3, "saguaro": {"device": "cpu", **opts}}
    return EngineArgs(model=target, speculative_config=spec, enforce_eager=True, max_model_len=256,
                      dtype="float32").create_engine_config()


def test_front_end_refuses_heads_that_do_not_group(tmp_path, tiny_pair):
    draft = _draft(tmp_path, tiny_pair, "gqa3-2", hidden_size=192, num_attention_heads=3, num_key_value_heads=2,
                   head_dim=64)
    with pytest.raises(SaguaroConfigError) as err:
        _resolve(draft, tiny_pair[0])
    msg = str(err.value)
    assert msg.startswith("speculative_config.model: the draft") and "3 query heads are not a multiple of its 2 " \
        "key/value heads" in msg


def test_front_end_warns_of_a_cpu_head_size_the_kernel_cannot_run(tmp_path, tiny_pair, caplog):
    draft = _draft(tmp_path, tiny_pair, "head20", head_dim=20)
    with caplog.at_level(logging.WARNING, logger="vllm.saguaro"):
        cfg = _resolve(draft, tiny_pair[0])
    assert cfg.additional_config["saguaro"]["device"] == "cpu"
    assert "head size 20 is not a multiple of 8" in caplog.text and "plain-torch reference" in caplog.text


def test_front_end_refuses_a_gpu_drafter_its_kernels_cannot_run(tmp_path, tiny_pair, monkeypatch):
    """A CUDA drafter (faked: 2 GPUs): its own CUDA kernel runs head sizes 64 and 128 with at most 8 query heads
    per KV head; where vLLM has Triton the drafter runs vLLM's kernels instead (head size >= 16)."""
    import vllm.triton_utils

    from saguaro_vllm.frontend.resolve import check_draft_attention

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("SAGUARO_OPS", raising=False)
    monkeypatch.delenv("SAGUARO_ATTENTION", raising=False)
    monkeypatch.delenv("SAGUARO_DRAFT_ATTENTION", raising=False)
    head96 = pathlib.Path(_draft(tmp_path, tiny_pair, "head96", head_dim=96))
    head8 = pathlib.Path(_draft(tmp_path, tiny_pair, "head8", head_dim=8))
    group16 = pathlib.Path(_draft(tmp_path, tiny_pair, "group16", num_attention_heads=16, num_key_value_heads=1,
                                  head_dim=64))
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", False)
    for draft, why in ((head96, "head size 96 is not one of 64, 128"),
                       (group16, "16 query heads per key/value head are more than 8")):
        with pytest.raises(SaguaroConfigError) as err:
            check_draft_attention(draft, "cuda:1")
        msg = str(err.value)
        assert msg.startswith("speculative_config.model: the drafter's CUDA attention kernel on cuda:1 cannot run")
        assert why in msg and "saguaro.device 'cpu'" in msg and "SAGUARO_OPS=reference" in msg
    check_draft_attention(head96, "cpu")  # the CPU kernel takes it
    monkeypatch.setenv("SAGUARO_OPS", "reference")
    check_draft_attention(head96, "cuda:1")  # the reference runs anything
    monkeypatch.delenv("SAGUARO_OPS")
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)  # vLLM's kernels run every pass
    check_draft_attention(head96, "cuda:1")
    check_draft_attention(group16, "cuda:1")
    with pytest.raises(SaguaroConfigError, match="head size 8 is not one of 64, 128"):
        check_draft_attention(head8, "cuda:1")
    monkeypatch.setenv("SAGUARO_DRAFT_ATTENTION", "saguaro")  # the drafter's own kernels only
    with pytest.raises(SaguaroConfigError, match="head size 96 is not one of 64, 128"):
        check_draft_attention(head96, "cuda:1")
    # through resolve_for_engine: after the device is known
    from saguaro_vllm.frontend.resolve import resolve_for_engine

    cfg = parse_speculative_config({"method": "saguaro", "model": str(head96), "num_speculative_tokens": 3})[0]

    class Target:
        model, dtype, max_model_len = tiny_pair[0], torch.float32, 256

        @staticmethod
        def get_vocab_size():
            from saguaro_vllm.drafter.model.loader import read_model_info

            return read_model_info(tiny_pair[0]).vocab_size

    with pytest.raises(SaguaroConfigError, match="on cuda:1 cannot run this draft"):
        resolve_for_engine(cfg, Target, tp_size=1, is_cpu_platform=False, max_num_seqs=8)
