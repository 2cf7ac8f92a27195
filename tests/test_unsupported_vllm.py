"""On a vLLM the patches were not reviewed for, the plugin never breaks vLLM: one warning, no patch, plain
serving works; only `method: "saguaro"` is refused, before any engine starts, naming the versions and the fix.

The unsupported vLLM is the installed one with `vllm.__version__` set to another release before anything
reads it (the plugin reads the version from there); the engine runs in that one process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so every plugin load sees the faked version.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from saguaro_vllm import patches

SCRIPT = textwrap.dedent("""
    import json, multiprocessing, sys
    import vllm
    vllm.__version__ = sys.argv[3]  # the faked installed version

    from vllm import LLM, SamplingParams
    from saguaro_vllm.patches import UnsupportedVLLMVersion, _resolve_owner, _REGISTRY
    from saguaro_vllm.patches.compat import patch_targets

    if __name__ == "__main__":
        target, draft = sys.argv[1], sys.argv[2]
        kw = dict(model=target, dtype="float32", enforce_eager=True, max_model_len=128, max_num_seqs=4,
                  distributed_executor_backend="uni")
        refused = None
        try:
            LLM(speculative_config={"method": "saguaro", "model": draft, "num_speculative_tokens": 2}, **kw)
        except UnsupportedVLLMVersion as err:
            refused = str(err)
        engines_after_refusal = len(multiprocessing.active_children())
        llm = LLM(**kw)
        out = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=8))
        targets = patch_targets()  # imports the patch modules (declares, applies nothing)
        wrapped = []
        for patch in _REGISTRY.values():
            if not patch.when():  # not applied here either (e.g. the Ray executor's without ray)
                continue
            attr = getattr(_resolve_owner(patch.owner), patch.attr)
            where = getattr(getattr(attr, "__code__", None), "co_filename", "")
            if "saguaro_vllm" in where:  # a wrapper of ours (vLLM wraps some itself, e.g. inference_mode)
                wrapped.append([f"{patch.owner}.{patch.attr}", where])
        print("RESULT " + json.dumps({"refused": refused, "engines_after_refusal": engines_after_refusal,
                                      "tokens": len(out[0].outputs[0].token_ids), "wrapped": wrapped,
                                      "targets": len(targets)}))
""")


@pytest.mark.engine
def test_unsupported_vllm_serves_plainly_and_refuses_saguaro(tiny_pair, tmp_path):
    target, draft = tiny_pair
    script = tmp_path / "fake_version.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": os.pathsep.join(
               [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    env.pop("SAGUARO_VLLM_DISABLE", None)
    res = subprocess.run([sys.executable, str(script), target, draft, "0.35.0"], env=env, capture_output=True,
                         text=True, timeout=600, check=False)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    result = json.loads(next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # Saguaro: refused in the front end, naming the supported versions and the fix; no engine was started.
    assert result["refused"] and "vLLM 0.35.0 is installed" in result["refused"]
    assert ">= 0.32.0 and < 0.34.0" in result["refused"] and "pip install 'vllm>=0.32,<0.34'" in result["refused"]
    assert result["engines_after_refusal"] == 0
    # Plain serving: works, and none of the patches is in place: the one wrapper is the pass-through guard
    # (`patches.refuse_saguaro`, in patches/__init__.py), not spec_config's rewrite.
    assert result["tokens"] == 8
    assert result["targets"] >= 10
    assert len(result["wrapped"]) == 1, result["wrapped"]
    ((name, where),) = result["wrapped"]
    assert name == "vllm.engine.arg_utils:EngineArgs.create_speculative_config"
    assert where == patches.__file__
    # One warning in the whole process, however often vLLM loads its plugins.
    assert log.count("plain serving are not affected") == 1, log[-4000:]


def test_guard_passes_other_configs_through_unchanged():
    """The guard installed on an unsupported vLLM: every config but Saguaro's goes to vLLM's own function."""
    calls = []

    def create_speculative_config(self, *args):
        calls.append(args)
        return "vllm's result"

    guard = patches.refuse_saguaro(create_speculative_config, "unsupported")

    class Args:
        speculative_config = None

    args = Args()
    for spec in (None, {"method": "ngram"}, '{"method": "ngram"}', "not json"):
        args.speculative_config = spec
        assert guard(args, 1, 2) == "vllm's result"
    for spec in ({"method": "saguaro"}, '{"method": "saguaro", "model": "x"}'):
        args.speculative_config = spec
        with pytest.raises(patches.UnsupportedVLLMVersion, match="unsupported"):
            guard(args, 1, 2)
    assert len(calls) == 4
