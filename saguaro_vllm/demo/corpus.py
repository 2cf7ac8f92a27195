"""Training text for the demo pair: the Python standard library of the running interpreter.

Why the stdlib: it is present on every machine that can run this project, is a few MB of real,
varied code, and needs no download. It is split *by file* (not by line) into train and held-out parts so
that held-out prompts come from files neither model nor tokenizer has ever seen. The split depends only
on each file's path relative to the stdlib root, so it is stable across seeds and runs.
"""

from __future__ import annotations

import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Test suites are huge, repetitive and full of deliberately odd code; site-packages is not the stdlib.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
HELDOUT_PERCENT = 5


class CorpusError(RuntimeError):
    """The corpus directory is missing, unreadable or has no usable source files."""


def stdlib_dir() -> Path:
    """The pure-Python standard library directory of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Deterministic file-level split: about HELDOUT_PERCENT% of files, chosen by a hash of the path."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELDOUT_PERCENT


@dataclass(frozen=True)
class Corpus:
    """The source files of one directory tree, split into train and held-out relative paths."""

    root: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    @classmethod
    def load(cls, root: Path | None = None) -> Corpus:
        root = Path(root) if root is not None else stdlib_dir()
        if not root.is_dir():
            raise CorpusError(
                f"corpus directory {root} does not exist or is not a directory; "
                "pass --corpus DIR pointing at a tree of .py files (default: this interpreter's stdlib)"
            )
        try:
            files = sorted(
                p.relative_to(root).as_posix()
                for p in root.rglob("*.py")
                if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
            )
        except OSError as e:
            raise CorpusError(f"cannot list corpus directory {root}: {e}; check its permissions") from e
        train = tuple(f for f in files if not is_heldout(f))
        heldout = tuple(f for f in files if is_heldout(f))
        if len(train) < 2 or not heldout:
            raise CorpusError(
                f"corpus directory {root} has {len(files)} usable .py files; need enough for a train and "
                "a held-out split (the stdlib has ~800). Pass --corpus DIR with more source files"
            )
        return cls(root, train, heldout)

    def read(self, rel_path: str) -> str:
        path = self.root / rel_path
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CorpusError(f"cannot read corpus file {path}: {e}; fix its permissions or pass "
                              "--corpus DIR with a readable tree") from e
        # A few stdlib files are latin-1; byte-level BPE copes with anything, keep the text round-trippable.
        return data.decode("utf-8", errors="replace")

    def texts(self, split: str) -> list[str]:
        names = {"train": self.train, "heldout": self.heldout}[split]
        return [self.read(f) for f in names]


def snippets(texts: list[str], n: int, chars: int, seed: int) -> Iterator[str]:
    """Yield `n` prompt snippets of about `chars` characters, each starting at a line start.

    Snippets that are mostly blank are skipped; sampling is deterministic in `seed`.
    """
    rng = random.Random(seed)
    usable = [t for t in texts if len(t) > 2 * chars]
    if not usable:
        raise CorpusError(f"no corpus text is longer than {2 * chars} characters; cannot cut prompts")
    made = 0
    while made < n:
        text = rng.choice(usable)
        start = text.rfind("\n", 0, rng.randrange(len(text) - chars)) + 1
        end = text.rfind("\n", start, start + chars)
        snippet = text[start : end + 1 if end > start else start + chars]
        if len(snippet.strip()) >= chars // 3:
            made += 1
            yield snippet
