"""Front-end decisions for GPU drafters, checked without a GPU: the drafter's KV cache size (`kv_cache_gb`
"auto"), the Ray executor's placement decisions in the front end, and the draft model's download (offline only: this machine has
no network, and HF_HUB_OFFLINE=1 must never touch it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
from saguaro_vllm.drafter.kv_cache import AUTO_KV_FRACTION, AUTO_KV_GIB, kv_budget_bytes
from saguaro_vllm.frontend.resolve import resolve_device, resolve_kv_cache_gb

GIB = 2**30


def _cfg(**opts):
    return parse_speculative_config({"method": "saguaro", "model": "d", "num_speculative_tokens": 3,
                                     "saguaro": opts})[0]


# ---- kv_cache_gb "auto" -------------------------------------------------------------------------------------
def test_kv_budget_auto_is_a_share_of_free_gpu_memory_and_1_gib_elsewhere():
    assert AUTO_KV_GIB == 1.0 and AUTO_KV_FRACTION == 0.5
    assert kv_budget_bytes("auto", "cpu") == GIB  # the old default, on CPU
    assert kv_budget_bytes(2.5, "cuda:1", free_bytes=lambda: 0) == int(2.5 * GIB)  # a number means GiB anywhere
    assert kv_budget_bytes(0.25, "cpu") == GIB // 4
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: 70 * GIB) == 35 * GIB  # half the free memory
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: 2 * GIB) == GIB
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: 3 * GIB // 2) == GIB  # at least 1 GiB if it fits
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: GIB) == GIB // 2  # (leaving 512 MiB free)
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: GIB // 4) == GIB // 8
    assert kv_budget_bytes("auto", "cuda:1", free_bytes=lambda: 0) == 0  # the drafter then fails to start, naming why


def test_kv_cache_gb_auto_resolves_per_device():
    auto = _cfg()
    assert auto.saguaro.kv_cache_gb == "auto"
    assert resolve_kv_cache_gb(auto, "cpu", 1) == 1.0
    assert resolve_kv_cache_gb(auto, "cuda:1", 1) == "auto"  # a GPU of its own: the drafter measures it
    assert resolve_kv_cache_gb(auto, "cuda:2", 2) == "auto"
    assert resolve_kv_cache_gb(auto, "cuda:0", 1) == 1.0  # shared with the target's GPU
    assert resolve_kv_cache_gb(auto, "cuda:3", 2, 2) == 1.0  # one of TP x PP = 4 target GPUs
    assert resolve_kv_cache_gb(auto, "cuda:1", 1, use_ray=True) == 1.0  # Ray places the target: maybe shared
    assert resolve_kv_cache_gb(_cfg(kv_cache_gb=3), "cuda:1", 1) == 3.0
    assert resolve_kv_cache_gb(_cfg(kv_cache_gb=0.5), "cpu", 1) == 0.5


def test_default_kv_cache_reaches_the_drafter_as_1_gib_on_cpu(tiny_pair):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    target, draft = tiny_pair
    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3, "saguaro": {"device": "cpu"}}
    cfg = EngineArgs(model=target, speculative_config=spec, enforce_eager=True, max_model_len=256,
                     dtype="float32").create_engine_config()
    assert cfg.additional_config["saguaro"]["saguaro"]["kv_cache_gb"] == 1.0
    assert current_platform.is_cpu() or cfg.additional_config["saguaro"]["device"] == "cpu"


# ---- the Ray executor -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
def test_ray_auto_device_is_reserved_through_ray_and_explicit_ones_are_kept(monkeypatch, tp):
    from saguaro_vllm.frontend.resolve import RAY_RESERVED

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert resolve_device(_cfg(), False, tp) == f"cuda:{tp}"  # mp: the first GPU after the target's
    assert resolve_device(_cfg(), False, tp, use_ray=True) == RAY_RESERVED == "cuda"  # the worker sets the index
    assert resolve_kv_cache_gb(_cfg(), RAY_RESERVED, tp, use_ray=True) == "auto"  # a GPU of its own
    assert resolve_device(_cfg(device="cuda:0"), False, tp, use_ray=True) == "cuda:0"  # explicit: as the worker sees it
    assert resolve_device(_cfg(device="cpu"), False, tp, use_ray=True) == "cpu"
    with pytest.raises(SaguaroConfigError, match=r"'cuda:9' does not exist .*under the Ray executor set "
                                                 r"saguaro.device"):
        resolve_device(_cfg(device="cuda:9"), False, tp, use_ray=True)


def test_ray_placement_options_outside_their_executor_are_refused(monkeypatch):
    from saguaro_vllm.frontend.device_placement import resolve_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.device: 'auto' reserves the drafter's "
                                                 r"GPU when vLLM's Ray executor V2 starts, but "
                                                 r"VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0"):
        resolve_devices(_cfg(), False, 2, use_ray=True, ray_legacy=True)
    assert resolve_devices(_cfg(device="cuda:3"), False, 2, use_ray=True, ray_legacy=True) == ["cuda:3"]
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.ray_node: names a Ray node, but "
                                                 r"vLLM's Ray executor does not run the workers"):
        resolve_devices(_cfg(ray_node="10.0.0.2"), False, 2)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.devices: places drafters on the GPUs "
                                                 r"of vLLM's multiproc executor, but Ray places the workers here"):
        resolve_devices(_cfg(devices=["cuda:2", "cuda:3"]), False, 1, dp_size=2, use_ray=True)


def test_ray_through_vllms_front_end(tiny_pair, monkeypatch):
    """vLLM's `EngineArgs.create_speculative_config` (plugin patches applied) with a Ray parallel config on a
    CUDA platform (faked: 4 GPUs): vLLM 0.32's older Ray executor is refused before any engine process starts;
    with the default one the drafter's GPU is left to the reservation at executor start."""
    import multiprocessing

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    target, draft = tiny_pair
    spec = {"method": "saguaro", "model": draft, "num_speculative_tokens": 3, "saguaro": {"mode": "sync"}}
    args = EngineArgs(model=target, speculative_config=dict(spec), enforce_eager=True, max_model_len=256,
                      dtype="float32", max_num_seqs=8)
    model_config = args.create_model_config()
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    ray = types.SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, distributed_executor_backend="ray",
                                use_ray=True)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.device: 'auto' reserves the "
                                                 r"drafter's GPU when vLLM's Ray executor V2 starts"):
        args.create_speculative_config(model_config, ray)
    assert not multiprocessing.active_children()
    from saguaro_vllm.frontend.resolve import resolve_for_engine

    cfg = parse_speculative_config(spec)[0]
    resolved = resolve_for_engine(cfg, model_config, tp_size=2, is_cpu_platform=False, max_num_seqs=8, use_ray=True)
    assert resolved["device"] == "cuda" and resolved["ray_reserve"] and resolved["saguaro"]["kv_cache_gb"] == "auto"
    resolved = resolve_for_engine(cfg, model_config, tp_size=2, is_cpu_platform=False, max_num_seqs=8)
    assert resolved["device"] == "cuda:2" and not resolved["ray_reserve"]
    assert resolved["saguaro"]["kv_cache_gb"] == "auto"


# ---- the draft model from the Hugging Face hub, offline ---------------------------------------------------------
RESOLVE = textwrap.dedent("""
    import json, socket, sys

    def no_network(*args, **kwargs):
        raise AssertionError("network touched")

    socket.socket.connect = socket.socket.connect_ex = no_network
    socket.create_connection = no_network
    from saguaro_vllm.frontend.config import SaguaroConfigError
    from saguaro_vllm.frontend.resolve import resolve_draft_path

    results = []
    for model, revision, download_dir in json.loads(sys.argv[1]):
        try:
            results.append({"path": str(resolve_draft_path(model, download_dir, revision))})
        except SaguaroConfigError as err:
            results.append({"error": str(err)})
    print(json.dumps(results))
""")


def _resolve_offline_many(tmp_path, queries: list[tuple], hf_home=None) -> list[dict]:
    """`resolve_draft_path` for each (model, revision, download_dir) in one offline process without network
    (one interpreter start: importing vLLM costs seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hf_home or tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps([list(q) for q in queries])], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fake_hub_cache(hub: "os.PathLike", repo: str, source_dir: str, commit: str, ref: str = "main") -> str:
    """`repo` in the hub cache layout under `hub` (refs/REF -> COMMIT, snapshots/COMMIT/ with files linked to
    blobs/), holding `source_dir`'s files: what `hf download` leaves."""
    import hashlib
    import pathlib
    import shutil

    root = pathlib.Path(hub) / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    for f in pathlib.Path(source_dir).iterdir():
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return os.path.realpath(snapshot)


def test_offline_draft_missing_from_the_cache_is_a_clear_error(tmp_path):
    got, tagged, path_like = _resolve_offline_many(tmp_path, [
        ("saguaro-test/not-cached-draft", None, None), ("saguaro-test/not-cached-draft", "v2", None),
        ("/nonexistent/draft", None, None)])
    msg = got["error"]
    assert msg.startswith("speculative_config.model: draft model 'saguaro-test/not-cached-draft' is not in the "
                          "local Hugging Face cache (")
    assert str(tmp_path / "hf-home" / "hub") in msg and "HF_HUB_OFFLINE=1 forbids downloading it" in msg
    assert "hf download saguaro-test/not-cached-draft" in msg and "unset HF_HUB_OFFLINE" in msg
    assert "at revision 'v2'" in tagged["error"]
    assert path_like["error"].startswith("speculative_config.model: draft model '/nonexistent/draft' not found")


def test_offline_draft_in_the_cache_resolves_without_network(tmp_path, tiny_pair):
    _, draft = tiny_pair
    commit, other = "a" * 40, "b" * 40
    snapshot = _fake_hub_cache(tmp_path / "hf-home" / "hub", "saguaro-test/tiny-draft", draft, commit)
    tagged = _fake_hub_cache(tmp_path / "hf-home" / "hub", "saguaro-test/tiny-draft", draft, other, ref="v2")
    # vLLM's --download-dir is the cache the draft is looked up in (and downloaded to)
    elsewhere = _fake_hub_cache(tmp_path / "downloads", "saguaro-test/tiny-draft", draft, commit)
    main, v2, pinned, downloads, empty = _resolve_offline_many(tmp_path, [
        ("saguaro-test/tiny-draft", None, None), ("saguaro-test/tiny-draft", "v2", None),
        ("saguaro-test/tiny-draft", commit, None), ("saguaro-test/tiny-draft", None, str(tmp_path / "downloads")),
        ("saguaro-test/tiny-draft", None, str(tmp_path / "empty"))])
    assert main == {"path": snapshot}
    assert v2 == {"path": tagged}
    assert pinned == {"path": snapshot}
    assert downloads == {"path": elsewhere}
    assert f"({tmp_path / 'empty'})" in empty["error"]
