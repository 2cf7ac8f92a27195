"""Each config in configs/ parses and resolves, against faked GPUs, to the layout the README says it serves:
the draft's real shape (config.json of the hub model, no weights), vLLM's GPU platform and CUDA device count
faked, so the front end's decisions (device, KV cache, dtype, CUDA graphs, attention kernel, proposal
transport) run here as on the GPU machine."""
from __future__ import annotations

import json
import pathlib
import types

import pytest
import torch

from saguaro_vllm.frontend import resolve
from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: The drafts' config.json as published on the hub (the fields the drafter reads).
DRAFTS = {
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "torch_dtype": "bfloat16"},
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16"},
}

#: config -> the layout it is for: target, its vocabulary, tensor parallel size, GPUs needed, and what the
#: front end resolves (the drafter's device, its KV cache: "auto" = half the free memory of a GPU of its own).
LAYOUTS = {
    "saguaro.json": dict(target="meta-llama/Llama-3.1-8B-Instruct", vocab=128256, tp=1, gpus=2,
                         device="cuda:1", kv="auto"),
    "llama-3.3-70b-tp4.json": dict(target="meta-llama/Llama-3.3-70B-Instruct", vocab=128256, tp=4, gpus=5,
                                   device="cuda:4", kv="auto"),
    "qwen3-32b-tp2.json": dict(target="Qwen/Qwen3-32B", vocab=151936, tp=2, gpus=3, device="cuda:2", kv="auto"),
    "one-gpu.json": dict(target="meta-llama/Llama-3.1-8B-Instruct", vocab=128256, tp=1, gpus=1, device="cuda:0",
                         kv=2.0),
    # data parallel 2: one engine per GPU 0 and 1, one drafter per engine on GPUs 2 and 3
    "llama-3.1-8b-dp2.json": dict(target="meta-llama/Llama-3.1-8B-Instruct", vocab=128256, tp=1, dp=2, gpus=4,
                                  device="cuda:2", devices=["cuda:2", "cuda:3"], kv="auto"),
}


#: Configs whose drafter runs on another host (docs/layouts.md): resolved without a local draft.
REMOTE = {"remote-drafter.json"}


def test_every_shipped_gpu_config_has_a_layout():
    gpu = {p.name for p in (ROOT / "configs").glob("*.json")} - {"saguaro-cpu-demo.json"} - REMOTE
    assert gpu == set(LAYOUTS)


@pytest.mark.parametrize("name", sorted(REMOTE))
def test_remote_config_resolves_with_its_secret(name, tmp_path):
    """A remote drafter's config resolves with no draft on this host, once its secret file exists and is
    private; until then the front end refuses it, naming the field and the fix."""
    from saguaro_vllm.frontend.remote import resolve_remote

    raw = json.loads((ROOT / "configs" / name).read_text())
    target = types.SimpleNamespace(model="meta-llama/Llama-3.1-8B-Instruct", dtype=torch.bfloat16,
                                   max_model_len=8192, get_vocab_size=lambda: 128256)
    cfg = parse_speculative_config(raw)[0]
    with pytest.raises(SaguaroConfigError, match=r"speculative_config\.saguaro\.drafter_secret_file: cannot read"):
        resolve_remote(cfg, target, tp_size=1, is_cpu_platform=False, max_num_seqs=256)
    secret = tmp_path / "drafter.secret"
    secret.write_text("a-secret-of-at-least-16-bytes\n")
    secret.chmod(0o644)
    raw["saguaro"]["drafter_secret_file"] = str(secret)
    cfg = parse_speculative_config(raw)[0]
    with pytest.raises(SaguaroConfigError, match="chmod 600"):
        resolve_remote(cfg, target, tp_size=1, is_cpu_platform=False, max_num_seqs=256)
    secret.chmod(0o600)
    got = resolve_remote(cfg, target, tp_size=1, is_cpu_platform=False, max_num_seqs=256)
    assert got["saguaro"]["drafter_endpoint"] == raw["saguaro"]["drafter_endpoint"]
    assert got["device"].startswith("remote tcp://") and got["vocab_size"] == 128256
    assert got["saguaro"]["proposal_transport"] == "host" and got["draft_cores"] == []


def _resolve(name: str, gpus: int, tmp_path, monkeypatch, use_ray: bool = False) -> dict:
    layout = LAYOUTS[name]
    cfg = parse_speculative_config(json.loads((ROOT / "configs" / name).read_text()))[0]
    draft_dir = tmp_path / cfg.model.replace("/", "--")
    draft_dir.mkdir(exist_ok=True)
    (draft_dir / "config.json").write_text(json.dumps(DRAFTS[cfg.model]))
    (draft_dir / "model.safetensors").write_bytes(b"")  # found, never read

    def fake_download(model, download_dir=None, revision=None):
        assert model == cfg.model
        return draft_dir

    monkeypatch.setattr(resolve, "resolve_draft_path", fake_download)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    target = types.SimpleNamespace(model=layout["target"], dtype=torch.bfloat16, max_model_len=8192,
                                   get_vocab_size=lambda: layout["vocab"])
    return resolve.resolve_for_engine(cfg, target, tp_size=layout["tp"], is_cpu_platform=False, max_num_seqs=256,
                                      dp_size=layout.get("dp", 1), use_ray=use_ray)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_config_resolves_on_its_gpus(name, tmp_path, monkeypatch):
    layout = LAYOUTS[name]
    got = _resolve(name, layout["gpus"], tmp_path, monkeypatch)
    assert got["device"] == layout["device"]
    assert got["saguaro"]["kv_cache_gb"] == layout["kv"]
    assert got["dtype"] == "bfloat16" and got["saguaro"]["cuda_graphs"] is True
    assert got["saguaro"]["linear"] == "plain" and got["draft_cores"] == []
    assert got["vocab_size"] == layout["vocab"]
    assert [r["device"] for r in got["dp_ranks"]] == layout.get("devices", [layout["device"]])


def test_auto_config_under_ray_leaves_the_gpu_to_the_reservation(tmp_path, monkeypatch):
    """`configs/qwen3-32b-tp2.json` (`device: auto`) serves under vLLM's Ray executor unchanged: the drafter's GPU
    is reserved when the executor starts (patches/ray_executor.py), with a KV cache sized on it."""
    got = _resolve("qwen3-32b-tp2.json", 2, tmp_path, monkeypatch, use_ray=True)
    assert got["device"] == "cuda" and got["ray_reserve"] and got["saguaro"]["kv_cache_gb"] == "auto"


@pytest.mark.parametrize("name", [n for n in sorted(LAYOUTS) if LAYOUTS[n]["gpus"] > 1])
def test_config_is_refused_with_one_gpu_too_few(name, tmp_path, monkeypatch):
    """A draft GPU past those vLLM sees is a config error before any engine starts, naming the device."""
    with pytest.raises(SaguaroConfigError, match=r"speculative_config\.saguaro\.device: '?(auto|cuda:\d)"):
        _resolve(name, LAYOUTS[name]["gpus"] - 1, tmp_path, monkeypatch)


def test_a_draft_of_another_vocabulary_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(LAYOUTS["qwen3-32b-tp2.json"], "vocab", 128256)
    with pytest.raises(SaguaroConfigError, match="differs from the target's"):
        _resolve("qwen3-32b-tp2.json", 3, tmp_path, monkeypatch)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_readme_serves_each_config_with_its_target(name):
    """The README's command for each config names its target and tensor parallel size."""
    layout = LAYOUTS[name]
    lines = [line for line in (ROOT / "README.md").read_text().splitlines()
             if f"configs/{name}" in line and line.lstrip().startswith("vllm serve")]
    assert lines, f"README.md has no `vllm serve ... configs/{name}` line"
    tp = f"--tensor-parallel-size {layout['tp']}" if layout["tp"] > 1 else ""
    dp = f"--data-parallel-size {layout['dp']}" if layout.get("dp", 1) > 1 else ""
    assert any(layout["target"] in line and tp in line and dp in line for line in lines), lines
