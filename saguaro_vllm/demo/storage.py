"""Crash-safe output directories for the demo pair: temp dir + rename, and a completion marker.

Why: a build takes minutes and writes gigabytes; an interrupted build must never leave a directory that
looks like a valid model. Everything is written into a hidden temp dir beside the destination and renamed
into place at the end; the marker (written last) lists every file with its size, so a truncated or
partly deleted cache is detected cheaply on the next call.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = ".saguaro-demo-pair.json"


class DemoPairError(RuntimeError):
    """A user-facing problem with the output directory or the cache; the message says what to do."""


def check_writable_parent(out: Path) -> None:
    """Fail fast (before minutes of training) if `out` cannot be created or replaced."""
    parent = out.parent
    if not parent.is_dir():
        raise DemoPairError(
            f"cannot create {out}: parent directory {parent} does not exist; "
            f"create it first (mkdir -p {parent}) or choose another --out"
        )
    try:  # a real probe: os.access says yes to root even on read-only or virtual filesystems
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        raise DemoPairError(f"cannot write to {parent} ({e.strerror}); choose a writable --out") from e
    if out.exists() and not out.is_dir():
        raise DemoPairError(f"{out} exists and is not a directory; remove it or choose another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise DemoPairError(
            f"{out} is a non-empty directory that is not a demo pair built by saguaro-vllm; refusing to "
            "overwrite it. Choose a new or empty --out"
        )


def manifest(root: Path) -> dict[str, int]:
    """Relative path -> size of every regular file under `root` except the marker."""
    return {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MARKER and not p.relative_to(root).parts[0].startswith(".")
    }


def write_marker(root: Path, key: str, extra: dict | None = None) -> None:
    """Write the completion marker last, atomically."""
    write_json_atomic(root / MARKER, {"key": key, "files": manifest(root), **(extra or {})})


def read_marker(root: Path) -> tuple[dict | None, str]:
    """(marker, "") if `root` is a complete demo pair directory, else (None, why not)."""
    path = root / MARKER
    if not path.is_file():
        return None, f"no completion marker {path}"
    try:
        marker = json.loads(path.read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable completion marker {path} ({e})"
    for rel, size in files.items():
        p = root / rel
        if not p.is_file():
            return None, f"missing file {p}"
        if p.stat().st_size != size:
            return None, f"file {p} has {p.stat().st_size} bytes, expected {size} (truncated or modified)"
    return marker, ""


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


@contextmanager
def staging_dir(dest: Path) -> Iterator[Path]:
    """Yield a fresh hidden temp dir beside `dest`; on success it replaces `dest`, on failure it is removed.

    Callers hold the build lock, so leftovers of earlier killed builds for the same `dest` are cleared.
    """
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    except OSError as e:
        raise DemoPairError(
            f"cannot create a temporary directory in {dest.parent}: {e}; choose a writable --out"
        ) from e
    try:
        yield tmp
        _normalise_permissions(tmp)
        replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _normalise_permissions(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; give the result the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def replace_dir(src: Path, dest: Path) -> None:
    """Move `src` to `dest`, replacing an existing `dest` (renamed aside first, then deleted)."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.tmp-old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
    os.rename(src, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free
