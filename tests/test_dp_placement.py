"""Data parallelism: every DP rank's engine gets its own drafter on its own device or cores, decided in the front
end before any engine starts (collisions refused, naming the field and the fix); each engine's output worker
takes its own rank's entry; Saguaro's metrics carry vLLM's `engine` label.

The GPU cases fake the device count: the front end's decisions are pure arithmetic over vLLM's assignment
(rank d's workers on logical GPUs [d x W, (d+1) x W), `--device-ids` mapping logical to physical GPUs,
CUDA_VISIBLE_DEVICES physical to visible ones)."""
from __future__ import annotations

import os
import types

import pytest

from saguaro_vllm.frontend.config import SaguaroConfigError, parse_speculative_config
from saguaro_vllm.frontend.device_placement import resolve_devices, target_gpus, visible_index


def _cfg(**opts):
    return parse_speculative_config({"method": "saguaro", "model": "d", "num_speculative_tokens": 3,
                                     "saguaro": opts})[0]


# ---- GPUs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("gpus", "tp", "dp", "device_ids", "expected"), [
    (2, 1, 1, None, ["cuda:1"]),                       # without DP: the first GPU after the target's, as before
    (4, 1, 2, None, ["cuda:2", "cuda:3"]),             # targets 0 | 1: GPU 1 is rank 1's, so rank 0's drafter takes 2
    (6, 2, 2, None, ["cuda:4", "cuda:5"]),             # targets 0,1 | 2,3
    (4, 1, 2, [0, 2], ["cuda:1", "cuda:3"]),           # --device-ids 0,2: each drafter right after its target
    (4, 1, 2, [2, 3], ["cuda:0", "cuda:1"]),           # none after: wraps around to the first free GPU
    (8, 2, 3, None, ["cuda:6", "cuda:7", None]),       # 3 x 2 targets and only 2 GPUs left
])
def test_auto_gives_each_rank_the_first_free_gpu_after_its_targets(gpus, tp, dp, device_ids, expected):
    if None in expected:
        with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.device: 'auto' needs a free GPU "
                                                     r"for each of the 3 data-parallel ranks' drafters, but their "
                                                     r"targets use 6 of 8 GPUs .*saguaro.devices"):
            resolve_devices(_cfg(), False, tp, dp_size=dp, gpu_count=gpus, device_ids=device_ids)
        return
    assert resolve_devices(_cfg(), False, tp, dp_size=dp, gpu_count=gpus, device_ids=device_ids) == expected


def test_target_gpus_follow_vllms_assignment_through_device_ids_and_visible_devices():
    assert target_gpus(2, 2, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # physical GPUs 5 and 7 of CUDA_VISIBLE_DEVICES=4,5,6,7 are visible as 1 and 3
    assert target_gpus(1, 1, 2, device_ids=[5, 7], device_control="4,5,6,7") == [[1], [3]]
    assert visible_index(3, None) == 3 and visible_index(3, "1,3") == 1
    with pytest.raises(SaguaroConfigError, match=r"GPU 2 is not in CUDA_VISIBLE_DEVICES=1,3"):
        visible_index(2, "1,3")


def test_explicit_per_rank_devices_are_kept_and_checked():
    assert resolve_devices(_cfg(devices=["cuda:3", "cuda:2"]), False, 1, dp_size=2, gpu_count=4) == ["cuda:3", "cuda:2"]
    # a drafter on a target GPU is allowed (shared), as `device: cuda:N` is without DP
    assert resolve_devices(_cfg(devices=["cuda:1", "cuda:0"]), False, 1, dp_size=2, gpu_count=2) == ["cuda:1", "cuda:0"]
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.devices: puts two data-parallel ranks' "
                                                 r"drafters on cuda:2; give each rank a GPU of its own"):
        resolve_devices(_cfg(devices=["cuda:2", "cuda:2"]), False, 1, dp_size=2, gpu_count=4)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.devices: gives 3 device\(s\) for 2 local "
                                                 r"data-parallel rank\(s\) .*give one per rank"):
        resolve_devices(_cfg(devices=["cuda:2", "cuda:3", "cuda:1"]), False, 1, dp_size=2, gpu_count=4)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.devices: 'cuda:7' does not exist"):
        resolve_devices(_cfg(devices=["cuda:2", "cuda:7"]), False, 1, dp_size=2, gpu_count=4)


def test_one_explicit_gpu_for_all_ranks_is_a_collision_naming_the_fix():
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.device: 'cuda:3' would put the drafters "
                                                 r"of all 2 data-parallel ranks on one GPU; give each rank its own with "
                                                 r"saguaro.devices \(one per rank, e.g. \['cuda:2', 'cuda:3'\]\)"):
        resolve_devices(_cfg(device="cuda:3"), False, 1, dp_size=2, gpu_count=4)
    assert resolve_devices(_cfg(device="cpu"), False, 1, dp_size=2, gpu_count=2) == ["cpu", "cpu"]
    assert resolve_devices(_cfg(), True, 1, dp_size=2) == ["cpu", "cpu"]  # the CPU build
    with pytest.raises(SaguaroConfigError, match=r"saguaro.devices: 'cuda:1' is not available with the CPU build"):
        resolve_devices(_cfg(devices=["cpu", "cuda:1"]), True, 1, dp_size=2)


def test_config_refuses_devices_beside_an_explicit_device():
    with pytest.raises(SaguaroConfigError, match=r"saguaro.devices: gives each data-parallel rank's device, and "
                                                 r"saguaro.device \('cuda:1'\) one device for all"):
        _cfg(device="cuda:1", devices=["cuda:1", "cuda:2"])
    with pytest.raises(SaguaroConfigError, match=r"saguaro.devices: entries must be 'cpu' or 'cuda:N'"):
        _cfg(devices=["gpu1"])


# ---- CPU cores ---------------------------------------------------------------------------------------------
def _placement(monkeypatch, cores: int, world: int, dp: int, bind: str | None = None, **saguaro):
    from saguaro_vllm.frontend.cpu_placement import resolve_cpu_placement

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    return resolve_cpu_placement(_cfg(**saguaro), world, dp)


def test_each_dp_rank_is_placed_within_its_own_share_of_the_cores(monkeypatch):
    p = _placement(monkeypatch, 8, 1, 2)
    assert p.drafts == [[2, 3], [6, 7]] and p.ranks == [[0, 1], [4, 5]] and p.shared == []
    assert p.omp_threads_bind() == "0,1|4,5"  # vLLM slices it per DP rank: local_dp_rank x world_size
    p = _placement(monkeypatch, 12, 2, 2)
    assert p.ranks == [[0, 1], [2, 3], [6, 7], [8, 9]] and p.drafts == [[4, 5], [10, 11]]
    assert p.dp_ranks() == [([4, 5], [[0, 1], [2, 3]]), ([10, 11], [[6, 7], [8, 9]])]


def test_given_cores_are_split_per_dp_rank(monkeypatch):
    p = _placement(monkeypatch, 8, 1, 2, target_cores=[0, 1, 2, 3], draft_cores=[6, 7])
    assert p.ranks == [[0, 1], [2, 3]] and p.drafts == [[6], [7]]
    p = _placement(monkeypatch, 8, 1, 2, bind="0-1|2-3")  # the user's binding: drafters take what is left
    assert p.ranks == [[0, 1], [2, 3]] and p.drafts == [[4, 5], [6, 7]]


def test_two_cores_run_dp2_only_with_share_cores(monkeypatch):
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.share_cores: 1 target rank\(s\) and the "
                                                 r"drafter need at least 2 cores.*\(data-parallel rank 0 of 2 gets cores "
                                                 r"\[0\] of the 2 available\)"):
        _placement(monkeypatch, 2, 1, 2)
    p = _placement(monkeypatch, 2, 1, 2, share_cores=True)  # each drafter shares its own engine's core
    assert p.ranks == [[0], [1]] and p.drafts == [[0], [1]] and p.shared == [0, 1]


def test_drafter_core_collisions_name_the_field_and_the_fix(monkeypatch):
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.draft_cores: gives 1 core\(s\) for the "
                                                 r"drafters of 2 data-parallel ranks, each needs one of its own"):
        _placement(monkeypatch, 8, 1, 2, draft_cores=[7])
    p = _placement(monkeypatch, 8, 1, 2, draft_cores=[7], share_cores=True)  # both drafters on core 7
    assert p.drafts == [[7], [7]] and p.shared == [7]
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.draft_cores: cores \[4\] are also "
                                                 r"target cores for 2 target ranks \(data x tensor x pipeline "
                                                 r"parallel\) or another data-parallel rank's drafter cores"):
        _placement(monkeypatch, 8, 1, 2, target_cores=[0, 4], draft_cores=[4, 5])
    with pytest.raises(SaguaroConfigError, match=r"VLLM_CPU_OMP_THREADS_BIND='0-3' gives 1 core list\(s\) but the "
                                                 r"target has 2 rank\(s\) \(data x tensor x pipeline parallel\)"):
        _placement(monkeypatch, 8, 1, 2, bind="0-3")


# ---- the resolved config and each engine's share of it ----------------------------------------------------------
def test_each_engine_takes_its_own_ranks_entry():
    from saguaro_vllm.worker.rank_placement import dp_indices, for_dp_rank, placed_config

    cfg = {"device": "cuda:2", "draft_cores": [], "target_cores": [], "target_rank_cores": [],
           "saguaro": {"kv_cache_gb": "auto", "mode": "sync"},
           "dp_ranks": [{"device": "cuda:2", "draft_cores": [], "target_rank_cores": [], "kv_cache_gb": "auto"},
                        {"device": "cpu", "draft_cores": [6, 7], "target_rank_cores": [[4], [5]], "kv_cache_gb": 1.0}]}
    parallel = types.SimpleNamespace(data_parallel_index=3, data_parallel_rank_local=1)
    assert dp_indices(parallel) == (1, 3) and dp_indices(None) == (0, 0)
    one = placed_config(cfg, parallel, is_output_rank=True)
    assert one["device"] == "cpu" and one["draft_cores"] == [6, 7] and one["target_cores"] == [4, 5]
    assert one["target_rank_cores"] == [[4], [5]] and one["saguaro"]["kv_cache_gb"] == 1.0 and one["engine"] == 3
    assert cfg["saguaro"]["kv_cache_gb"] == "auto"  # the shared config is not changed
    assert for_dp_rank(cfg, 0, 0)["device"] == "cuda:2"
    with pytest.raises(ValueError, match=r"local data-parallel rank 2, but the front end placed drafters for 2"):
        for_dp_rank(cfg, 2, 2)


def test_resolved_config_holds_one_entry_per_dp_rank(tiny_pair, monkeypatch):
    """`resolve_for_engine` with DP=2 on a faked 4-GPU machine, then on the CPU build (faked 4 cores)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from saguaro_vllm.frontend.resolve import resolve_for_engine

    target, draft = tiny_pair
    model_config = EngineArgs(model=target, enforce_eager=True, max_model_len=256, dtype="float32").create_model_config()
    cfg = parse_speculative_config({"method": "saguaro", "model": draft, "num_speculative_tokens": 3})[0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpu = resolve_for_engine(cfg, model_config, tp_size=1, is_cpu_platform=False, max_num_seqs=8, dp_size=2)
    assert [r["device"] for r in gpu["dp_ranks"]] == ["cuda:2", "cuda:3"] and gpu["device"] == "cuda:2"
    assert [r["kv_cache_gb"] for r in gpu["dp_ranks"]] == ["auto", "auto"]  # GPUs of their own
    shared = parse_speculative_config({"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
                                       "saguaro": {"devices": ["cuda:3", "cuda:0"]}})[0]
    got = resolve_for_engine(shared, model_config, tp_size=1, is_cpu_platform=False, max_num_seqs=8, dp_size=2)
    assert [r["kv_cache_gb"] for r in got["dp_ranks"]] == ["auto", 1.0]  # cuda:0 is DP rank 0's target GPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("SAGUARO_SET_OMP_THREADS_BIND", raising=False)
    cpu = resolve_for_engine(cfg, model_config, tp_size=1, is_cpu_platform=True, max_num_seqs=8, dp_size=2)
    assert [(r["device"], r["draft_cores"], r["target_rank_cores"]) for r in cpu["dp_ranks"]] == [
        ("cpu", [1], [[0]]), ("cpu", [3], [[2]])]
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|2"


# ---- metrics ------------------------------------------------------------------------------------------------
def test_metrics_carry_the_engine_label_of_their_dp_rank():
    import logging

    import prometheus_client

    from saguaro_vllm.worker.metrics import SaguaroMetrics, saguaro_samples

    log = logging.getLogger("test")
    SaguaroMetrics({"engine": 0, "saguaro": {"log_interval_s": 0}}, log).on_step(0.01, 0.005, 2, 6)
    SaguaroMetrics({"engine": 1, "saguaro": {"log_interval_s": 0}}, log).on_step(0.01, 0.005, 1, 4)
    SaguaroMetrics({"engine": 1, "saguaro": {"log_interval_s": 0}}, log).on_failure("late")
    value = prometheus_client.REGISTRY.get_sample_value
    e0 = value("vllm:saguaro_draft_tokens_total", {"engine": "0"})
    e1 = value("vllm:saguaro_draft_tokens_total", {"engine": "1"})
    assert e0 is not None and e1 is not None and e1 >= 4
    assert value("vllm:saguaro_drafter_failures_total", {"reason": "late", "engine": "1"}) >= 1
    # a counter no event has reached yet is exported at 0 for each engine, as one without labels was
    assert value("vllm:saguaro_rows_no_room_total", {"engine": "1"}) is not None
    # a one-process engine's samples are read without the label (one engine per process)
    assert "vllm:saguaro_draft_tokens_total" in saguaro_samples()
    assert not any("engine=" in key for key in saguaro_samples())
