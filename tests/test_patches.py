"""The patch registry: version gate, one patch per attribute, originals kept, every patch applied here."""
from __future__ import annotations

import pytest

from saguaro_vllm import patches


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "0.10.0+cpu", "0.34.0rc1"])
def test_unsupported_vllm_versions_are_refused(version):
    with pytest.raises(patches.UnsupportedVLLMVersion,
                       match=r"supports vLLM >= 0\.32\.0 and < 0\.34\.0.*pip install 'vllm>=0\.32,<0\.34'"):
        patches.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.5", "0.32.1.dev3+gabc", "0.33.0", "0.33.2"])
def test_supported_versions_pass(version):
    patches.check_vllm_version(version)


def test_patching_the_same_attribute_twice_is_refused():
    @patches.vllm_patch("some.module:Cls", "attr_under_test", why="test")
    def first(original):
        return original

    try:
        with pytest.raises(RuntimeError, match="patched twice"):
            @patches.vllm_patch("some.module:Cls", "attr_under_test", why="test")
            def second(original):
                return original
    finally:
        patches._REGISTRY.pop(f"{first.__module__}.{first.__name__}")


def test_all_patches_applied_once_with_originals_kept():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from saguaro_vllm.plugin import register

    register()
    assert patches.apply_all() == []  # already applied by the plugin: nothing applied twice
    original = patches.original_of("vllm.engine.arg_utils:EngineArgs", "create_speculative_config")
    assert EngineArgs.create_speculative_config.__wrapped__ is original
    assert GPUModelRunner.propose_draft_token_ids.__wrapped__ is patches.original_of(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner", "propose_draft_token_ids")
