"""The installed vLLM's patch targets are the ones the patches were reviewed against (fingerprints.json), so a
vLLM update that changes a wrapped function fails here loudly; and the check itself tells a changed, moved or
re-signed target from an unchanged one (scripts/check_vllm_compat.py, docs/dev/vllm-compat.md)."""
from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from saguaro_vllm import patches
from saguaro_vllm.patches import compat

REPO = Path(__file__).resolve().parents[1]


def test_installed_vllm_matches_its_reviewed_fingerprints():
    version = md.version("vllm")
    reviewed = compat.load_reviewed()
    assert compat.release(version) in reviewed, (
        f"vLLM {version} has no reviewed fingerprints: read its patch targets (docs/dev/vllm-compat.md), then "
        f"`python scripts/check_vllm_compat.py installed --record`")
    bad = [r for r in compat.check(compat.installed_vllm_root(), version) if r.status != "ok"]
    assert not bad, f"patch targets changed in vLLM {version}; read them against the patches: {bad}"


def test_every_supported_release_and_every_target_is_fingerprinted():
    """Both supported releases were reviewed, and every patch target (and what the patches rely on) has a
    fingerprint in each."""
    reviewed = compat.load_reviewed()
    lo, hi = patches.SUPPORTED_VLLM
    assert {"0.32.0", "0.33.0"} <= set(reviewed)
    for release, targets in reviewed.items():
        assert lo <= patches.parse_version(release) < hi, f"{release} is outside SUPPORTED_VLLM"
        assert set(compat.all_targets()) <= set(targets), release
    # 0.33 differs from 0.32 in exactly the targets docs/dev/vllm-compat.md discusses.
    changed = {t for t in reviewed["0.32.0"] if reviewed["0.32.0"][t] != reviewed["0.33.0"][t]}
    doc = (REPO / "docs" / "dev" / "vllm-compat.md").read_text()
    for target in changed:
        assert f"`{target.split(':')[1]}`" in doc, f"{target} differs in 0.33 but docs/dev/vllm-compat.md omits it"


def _tree_with(tmp_path: Path, modules: list[str]) -> Path:
    """A copy of the installed vLLM's source files for `modules`, laid out as in the package."""
    root = compat.installed_vllm_root()
    out = tmp_path / "vllm"
    for module in modules:
        rel = Path(*module.split(".")[1:]).with_suffix(".py")
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, out / rel)
    return out


def test_check_finds_a_changed_body_a_new_signature_and_a_missing_target(tmp_path):
    version = md.version("vllm")
    modules = sorted({t.split(":")[0] for t in compat.all_targets()})
    tree = _tree_with(tmp_path, modules)
    assert all(r.status == "ok" for r in compat.check(tree, version))
    runner = tree / "v1" / "worker" / "gpu_model_runner.py"
    text = runner.read_text()
    # A comment is no change (the fingerprint is of the code); a statement is.
    body = text.replace("    def _get_spec_decode_draft_probs(", "    # a comment\n    def _get_spec_decode_draft_probs(", 1)
    runner.write_text(body)
    assert all(r.status == "ok" for r in compat.check(tree, version))
    body = body.replace("def _update_states(self, scheduler_output", "def _update_states(self, extra, scheduler_output")
    body = body.replace("def _sample(", "def _renamed_sample(")
    body = body.replace("def _bookkeeping_sync(\n        self,", "def _bookkeeping_sync(\n        self, extra,", 1)
    runner.write_text(body)
    status = {r.target.split(".")[-1]: r.status for r in compat.check(tree, version)}
    assert status["_update_states"] == "signature"
    assert status["_sample"] == "missing"
    assert status["_bookkeeping_sync"] == "signature"
    assert status["propose_draft_token_ids"] == "ok"
    code = runner.read_text().replace("drafter.propose(", "drafter.propose_changed(", 1)
    runner.write_text(code)
    assert {r.target.split(".")[-1]: r.status for r in compat.check(tree, version)}["propose_draft_token_ids"] \
        == "changed"


@pytest.mark.parametrize("edit", [False, True])
def test_script_checks_a_wheel(tmp_path, edit):
    """`scripts/check_vllm_compat.py VERSION --wheel W` reads the wheel's sources without importing them: a
    wheel holding the installed release's files passes, the same with one wrapped body changed fails."""
    version = md.version("vllm")
    tree = _tree_with(tmp_path, sorted({t.split(":")[0] for t in compat.all_targets()}))
    if edit:
        f = tree / "v1" / "sample" / "rejection_sampler.py"
        f.write_text(f.read_text().replace("target_logits = target_logits.clone()", "target_logits = target_logits", 1))
    wheel = tmp_path / f"vllm-{compat.release(version)}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for p in tree.rglob("*.py"):
            zf.write(p, p.relative_to(tmp_path).as_posix())
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "check_vllm_compat.py"), compat.release(version),
                          "--wheel", str(wheel)], capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == (1 if edit else 0), res.stdout + res.stderr
    assert ("FAIL vllm.v1.sample.rejection_sampler:RejectionSampler.forward: changed" in res.stdout) == edit
