"""`saguaro-vllm doctor`: one line per check, OK / WARN / FAIL with the fix, exit code 1 on a failure.

The CPU checks run on this machine as it is. The GPU paths (GPUs visible, the drafter's device, peer access,
CUDA torch) run with a FAKED machine (`doctor.Machine` with made-up GPU names and peer access), since these
tests run on CPU: they check doctor's reasoning about devices, not real GPUs.
"""
from __future__ import annotations

import json

import pytest

from saguaro_vllm.tools import cli, doctor


def _config(tmp_path, draft, **saguaro):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"method": "saguaro", "model": draft, "num_speculative_tokens": 3,
                                "saguaro": {"mode": "sync", **saguaro}}))
    return str(path)


def _by_name(checks):
    return {c.name: c for c in checks}


def test_cpu_machine_with_a_matching_pair_passes(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    rc = cli.main(["doctor", "--speculative-config", _config(tmp_path, draft, kv_cache_gb=0.05), target])
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert rc == 0, out
    assert all(line.split()[0] in ("OK", "WARN", "FAIL") for line in lines[:-1])
    names = [line.split(":")[0].split(None, 1)[1] for line in lines[:-1]]
    for name in ("vLLM", "model runner", "torch", "GPUs", "ops", "ops on cpu", "config", "placement",
                 "peer access", "draft", "KV memory", "/dev/shm"):
        assert name in names, (name, out)
    checks = _by_name(doctor.run_doctor(_config(tmp_path, draft, kv_cache_gb=0.05), target))
    assert checks["vLLM"].status == "OK" and "every patch target as reviewed" in checks["vLLM"].message
    assert checks["draft"].status == "OK" and "vocabulary 320" in checks["draft"].message
    assert checks["placement"].status == "OK" and "drafter on CPU cores" in checks["placement"].message
    assert checks["/dev/shm"].status == "OK" and "256 rows x K=3 x vocabulary 320" in checks["/dev/shm"].message
    assert checks["ops"].status == "OK" and "attention" in checks["ops on cpu"].message


def test_failures_name_the_fix(tiny_pair, tmp_path, monkeypatch):
    from tiny_models import _save_llama

    target, draft = tiny_pair
    other = tmp_path / "other-vocab"
    other.mkdir()
    _save_llama(other, None, vocab=77, seed=3)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    checks = _by_name(doctor.run_doctor(_config(tmp_path, str(other), kv_cache_gb=0.0001), target))
    assert checks["model runner"].status == "FAIL" and "unset VLLM_USE_V2_MODEL_RUNNER" in checks["model runner"].fix
    assert checks["draft"].status == "FAIL" and "vocabulary (77" in checks["draft"].message
    assert checks["KV memory"].status == "WARN" and "raise saguaro.kv_cache_gb" in checks["KV memory"].fix
    bad = doctor.run_doctor(str(tmp_path / "missing.json"), target)
    assert _by_name(bad)["config"].status == "FAIL" and "neither a JSON object nor" in _by_name(bad)["config"].message


def test_no_config_is_a_warning_not_a_failure():
    checks = _by_name(doctor.run_doctor(None, None))
    assert checks["config"].status == "WARN" and "--speculative-config FILE MODEL" in checks["config"].fix


def _fake_gpus(n, peer):
    """A FAKED GPU machine: n made-up CUDA devices, peer access as given (no real GPU is used)."""
    return doctor.Machine(cpu_platform=False, cuda_build="12.8", gpus=[f"FAKE GPU {i}" for i in range(n)],
                          peer_access=peer)


@pytest.mark.parametrize("peer", [True, False])
def test_gpu_placement_and_peer_access_on_faked_gpus(tiny_pair, tmp_path, peer):
    target, draft = tiny_pair
    machine = _fake_gpus(3, lambda a, b: peer)
    checks = _by_name(doctor.check_config(_config(tmp_path, draft), target, machine, tp=2, pp=1, max_num_seqs=8))
    assert "drafter on cuda:2" in checks["placement"].message and checks["placement"].status == "OK"
    assert checks["peer access"].status == ("OK" if peer else "WARN")
    if not peer:
        assert "cuda:[0, 1]" in checks["peer access"].message and "NVLink" in checks["peer access"].fix
    assert checks["KV memory"].status == "OK" and "free memory" in checks["KV memory"].message  # auto, own GPU
    assert _by_name(doctor.check_gpus(machine))["GPUs"].message.startswith("3 visible: cuda:0 FAKE GPU 0")
    assert _by_name(doctor.check_torch(machine))["torch"].status == "OK"


def test_faked_gpus_too_few_for_auto_placement(tiny_pair, tmp_path):
    target, draft = tiny_pair
    checks = _by_name(doctor.check_config(_config(tmp_path, draft), target, _fake_gpus(1, lambda a, b: True),
                                          tp=1, pp=1, max_num_seqs=None))
    assert checks["placement"].status == "FAIL" and "needs a free GPU" in checks["placement"].message
    assert doctor.check_gpus(_fake_gpus(0, lambda a, b: True))[0].status == "FAIL"
    no_cuda = doctor.Machine(cpu_platform=False, cuda_build=None, gpus=[], peer_access=lambda a, b: False)
    assert doctor.check_torch(no_cuda)[0].status == "FAIL"


def test_commands_missing_an_extra_refuse_naming_it(monkeypatch, capsys):
    """A command whose imports are absent names the extra that brings them (here a module name that does not
    exist stands for a missing vLLM)."""
    monkeypatch.setitem(cli.NEEDS, "demo", (("no_such_module_saguaro",), cli._VLLM_EXTRA))
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "needs no_such_module_saguaro" in err and "saguaro-vllm[cpu]" in err and "saguaro-vllm[gpu]" in err
    assert cli.missing_modules("make-demo-pair") == [] and cli.missing_modules("doctor") == []
