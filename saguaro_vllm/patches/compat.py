"""What each patch was reviewed against: the signature and a source fingerprint of every patched vLLM
function, per supported vLLM version (`fingerprints.json` beside this file).

A fingerprint is the sha256 of `ast.unparse` of the function's definition (decorators included, comments and
formatting ignored), read from the vLLM source files with `ast`, without importing vLLM: the same code
reads an installed vLLM and an unpacked wheel of any version (`scripts/check_vllm_compat.py`), including a
GPU wheel that cannot be imported here. A changed fingerprint means the wrapped function's body changed:
read it against the patch's assumptions (docs/dev/vllm-compat.md), then record the new fingerprint with
`scripts/check_vllm_compat.py VERSION --record`.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

FINGERPRINTS = Path(__file__).with_name("fingerprints.json")

#: vLLM functions the patches do not wrap but whose behaviour they rely on, fingerprinted beside the targets:
#: the all-greedy path `greedy_rejection.py` reproduces (`rejection_sample`, `_rejection_greedy_sample`, the
#: bonus-token `Sampler.forward` call, what `RejectionSampler.__init__` sets up), the model-runner choice
#: `spec_config.check_model_runner` guards (`VllmConfig.use_v2_model_runner` and its unsupported list), and
#: the Ray placement group `ray_executor.py` grows by one bundle and whose bundle order it predicts.
RELIED_ON = (
    "vllm.v1.sample.rejection_sampler:rejection_sample",
    "vllm.v1.sample.rejection_sampler:_rejection_greedy_sample",
    "vllm.v1.sample.rejection_sampler:RejectionSampler.__init__",
    "vllm.v1.sample.sampler:Sampler.forward",
    "vllm.config.vllm:VllmConfig.use_v2_model_runner",
    "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
    "vllm.v1.executor.ray_utils:initialize_ray_cluster",
    "vllm.v1.executor.ray_utils:get_bundles_sorted_by_node",
    "vllm.v1.executor.ray_utils:get_bundles_for_indices",
)


@dataclasses.dataclass(frozen=True)
class TargetReport:
    """One patch target in one vLLM source tree: `status` is "ok", "missing", "signature" or "changed"."""

    target: str
    status: str
    detail: str = ""


def all_targets() -> list[str]:
    """What is fingerprinted: every patch target, then `RELIED_ON`."""
    return patch_targets() + [t for t in RELIED_ON if t not in patch_targets()]


def patch_targets() -> list[str]:
    """Every attribute the patches wrap, as "module:Class.attr" or "module:attr", in registry order."""
    import importlib

    from saguaro_vllm.patches import _REGISTRY, PATCH_MODULES

    for mod in PATCH_MODULES:
        importlib.import_module(f"saguaro_vllm.patches.{mod}")
    out = []
    for patch in _REGISTRY.values():
        module, _, cls = patch.owner.partition(":")
        key = f"{module}:{cls + '.' if cls else ''}{patch.attr}"
        if key not in out:
            out.append(key)
    return out


def installed_vllm_root() -> Path:
    """The installed `vllm/` package directory (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("vLLM is not installed in this environment")
    return Path(spec.origin).parent


def _module_file(vllm_root: Path, module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    for candidate in (vllm_root / rel.with_suffix(".py"), vllm_root / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{module}: no source file under {vllm_root}")


def find_definition(vllm_root: Path, target: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The `def` of `target` ("module:Class.attr" or "module:attr") in the sources under `vllm_root`."""
    module, _, path = target.partition(":")
    try:
        tree = ast.parse(_module_file(vllm_root, module).read_text())
    except FileNotFoundError:
        return None
    scope: list[ast.stmt] = tree.body
    *classes, name = path.split(".")
    for cls in classes:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            return None
        scope = found[-1].body
    defs = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return defs[-1] if defs else None  # the last definition is the one Python keeps


def describe(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, str]:
    """{"signature": the parameters as written, "sha256": the fingerprint of the whole definition}."""
    return {"signature": ast.unparse(node.args),
            "sha256": hashlib.sha256(ast.unparse(node).encode()).hexdigest()}


def scan(vllm_root: Path, targets: list[str] | None = None) -> dict[str, dict[str, str] | None]:
    """Signature and fingerprint of every patch target under `vllm_root` (None where it does not exist)."""
    out: dict[str, dict[str, str] | None] = {}
    for target in targets or all_targets():
        node = find_definition(vllm_root, target)
        out[target] = describe(node) if node is not None else None
    return out


def release(version: str) -> str:
    """The release a version string belongs to in `fingerprints.json`: "0.32.0+cpu" -> "0.32.0"."""
    return version.split("+")[0]


def load_reviewed() -> dict[str, dict[str, dict[str, str] | None]]:
    """release -> target -> {"signature", "sha256"} (None: absent in that release, as reviewed)."""
    return json.loads(FINGERPRINTS.read_text())["versions"]


def record(vllm_root: Path, version: str) -> dict[str, dict[str, str] | None]:
    """Write the fingerprints of `version`'s targets into `fingerprints.json` (after reading them)."""
    data = json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {"versions": {}}
    data["versions"][release(version)] = found = scan(vllm_root)
    data["versions"] = dict(sorted(data["versions"].items()))
    FINGERPRINTS.write_text(json.dumps(data, indent=1) + "\n")
    return found


def check(vllm_root: Path, version: str) -> list[TargetReport]:
    """Every patch target under `vllm_root` against what was reviewed for `version` (KeyError: none was)."""
    reviewed = load_reviewed()[release(version)]
    found = scan(vllm_root, list(dict.fromkeys(all_targets() + list(reviewed))))
    reports = []
    for target, now in found.items():
        want = reviewed.get(target, "unreviewed")
        if want == "unreviewed":
            reports.append(TargetReport(target, "changed", "a patch target with no reviewed fingerprint"))
        elif now is None:
            reports.append(TargetReport(target, "ok" if want is None else "missing",
                                        "absent, as reviewed" if want is None else "not found"))
        elif want is None:
            reports.append(TargetReport(target, "changed", "exists, but was absent when reviewed"))
        elif now["signature"] != want["signature"]:
            reports.append(TargetReport(target, "signature",
                                        f"({now['signature']}), reviewed ({want['signature']})"))
        elif now["sha256"] != want["sha256"]:
            reports.append(TargetReport(target, "changed", f"source fingerprint {now['sha256'][:12]}, reviewed "
                                                           f"{want['sha256'][:12]}"))
        else:
            reports.append(TargetReport(target, "ok", now["sha256"][:12]))
    return reports
