"""Build (or reuse from the cache) the demo target/draft pair: the one entry point other code should call.

    from saguaro_vllm.demo.build import ensure_demo_pair
    pair = ensure_demo_pair()              # cached under ~/.cache/saguaro-vllm/, instant the second time
    pair.target, pair.draft                # HF model dirs (config.json, model.safetensors, tokenizer files)
    pair.target_cost, pair.draft_cost      # zero-padded cost-matched twins (if built)
    pair.heldout_prompts(8)                # text snippets from held-out stdlib files, for benchmarks

Why cached and keyed: the build trains for minutes, but its result is a pure function of the settings, the
seed and the corpus, so the cache directory name is a hash of exactly those.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock

from .corpus import Corpus
from .model import ModelShape
from .storage import (
    DemoPairError,
    check_writable_parent,
    free_bytes,
    read_marker,
    staging_dir,
    write_json_atomic,
    write_marker,
)

BUILDER_VERSION = 2  # bump when a build's outputs change for the same settings
TARGET_SHAPE = ModelShape(hidden=192, layers=2, heads=3, kv_heads=3, intermediate=512)
DRAFT_SHAPE = ModelShape(hidden=128, layers=1, heads=2, kv_heads=2, intermediate=344)
DEFAULT_MINUTES = 6.5
DEFAULT_TARGET_SCALE = "400M"
DEFAULT_DRAFT_SCALE = "50M"


def default_cache_root() -> Path:
    """$SAGUARO_VLLM_CACHE, else $XDG_CACHE_HOME/saguaro-vllm, else ~/.cache/saguaro-vllm."""
    if os.environ.get("SAGUARO_VLLM_CACHE"):
        return Path(os.environ["SAGUARO_VLLM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "saguaro-vllm"


@dataclass(frozen=True)
class BuildSettings:
    """Everything the trained pair depends on; its hash names the cache directory."""

    minutes: float = DEFAULT_MINUTES
    seed: int = 0
    target_shape: ModelShape = TARGET_SHAPE
    draft_shape: ModelShape = DRAFT_SHAPE
    vocab_size: int = 4096
    corpus: str | None = None  # None: this interpreter's stdlib
    distill: str = "soft"  # "soft": the target's distributions (v2); "hard": its greedy tokens (v1)

    def __post_init__(self) -> None:
        from .distill import RECIPES

        if self.distill not in RECIPES:
            raise DemoPairError(f"--distill must be one of {', '.join(RECIPES)}, got {self.distill!r}")
        if not self.minutes > 0:
            raise DemoPairError(f"--minutes must be positive, got {self.minutes}")
        if self.vocab_size < 512:
            raise DemoPairError(f"vocab size must be at least 512, got {self.vocab_size}")

    def key(self) -> str:
        corpus = str(Path(self.corpus).resolve()) if self.corpus else f"stdlib:{sys.version.split()[0]}"
        data = {**asdict(self), "corpus": corpus, "builder": BUILDER_VERSION}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class DemoPair:
    """A built pair: `root` holds target/, draft/ (sharing one tokenizer), stats.json, heldout.json and,
    when built, the cost-matched target-cost/ and draft-cost/ (same outputs, larger compute)."""

    root: Path
    stats: dict = field(repr=False)

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def draft(self) -> Path:
        return self.root / "draft"

    @property
    def target_cost(self) -> Path | None:
        return self.root / "target-cost" if "cost_matched" in self.stats else None

    @property
    def draft_cost(self) -> Path | None:
        return self.root / "draft-cost" if "cost_matched" in self.stats else None

    def heldout_prompts(self, n: int | None = None) -> list[str]:
        """Prompt snippets (~400 chars, line-aligned) cut from held-out files no model was trained on."""
        prompts = json.loads((self.root / "heldout.json").read_text())["prompts"]
        return prompts if n is None else prompts[:n]


def _log(msg: str) -> None:
    print(f"[make-demo-pair] {msg}", file=sys.stderr, flush=True)


def ensure_demo_pair(
    out: str | Path | None = None,
    minutes: float = DEFAULT_MINUTES,
    seed: int = 0,
    *,
    target_shape: ModelShape = TARGET_SHAPE,
    draft_shape: ModelShape = DRAFT_SHAPE,
    corpus: str | Path | None = None,
    distill: str = "soft",
    cost_matched: bool = True,
    target_scale: str = DEFAULT_TARGET_SCALE,
    draft_scale: str = DEFAULT_DRAFT_SCALE,
    threads: int | None = None,
    log: Callable[[str], None] = _log,
) -> DemoPair:
    """Return the demo pair for these settings, building it only if no valid copy exists at `out`.

    `out` defaults to `<cache root>/demo-pair-<settings hash>`. An existing directory that is a complete
    pair with the same settings is reused; a stale or corrupt pair there is rebuilt; any other non-empty
    directory is refused. Cost-matched models are added lazily (and replaced if the scales differ).
    """
    settings = BuildSettings(minutes, seed, target_shape, draft_shape, corpus=str(corpus) if corpus else None,
                             distill=distill)
    key = settings.key()
    if out is None:
        root = default_cache_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DemoPairError(f"cannot create the cache directory {root}: {e}; set SAGUARO_VLLM_CACHE "
                                "to a writable directory or pass --out") from e
        out = root / f"demo-pair-{key}"
    out = Path(out).expanduser().absolute()
    check_writable_parent(out)
    if cost_matched:  # fail on a bad scale or a full disk now, not after minutes of training
        _check_cost_matched(out, settings, target_scale, draft_scale)

    with FileLock(str(out.parent / f".{out.name}.lock")), _torch_threads(threads):
        marker, why = read_marker(out)
        if marker is not None and marker.get("key") == key:
            log(f"using cached demo pair {out}")
        else:
            if out.exists():
                log(f"rebuilding {out}: {why if marker is None else 'it was built with other settings'}")
            from .pipeline import build_pair

            source = Corpus.load(Path(corpus) if corpus else None)
            with staging_dir(out) as tmp:
                build_pair(tmp, settings, source, log)
                write_marker(tmp, key)
        pair = DemoPair(out, json.loads((out / "stats.json").read_text()))
        if cost_matched:
            pair = _ensure_cost_matched(pair, key, target_scale, draft_scale, log)
    return pair


def _check_cost_matched(out: Path, settings: BuildSettings, target_scale: str, draft_scale: str) -> None:
    """Validate the scales, and if the models must be written, that the disk can hold them."""
    from .cost_match import parse_scale

    vocab = settings.vocab_size
    try:
        shapes = [parse_scale(target_scale, settings.target_shape, vocab),
                  parse_scale(draft_scale, settings.draft_shape, vocab)]
    except ValueError as e:
        raise DemoPairError(f"{e}; fix --target-scale / --draft-scale or pass --no-cost-matched") from None
    try:
        have = json.loads((out / "stats.json").read_text()).get("cost_matched", {})
    except (OSError, ValueError):
        have = {}
    if have.get("target_scale") == target_scale and have.get("draft_scale") == draft_scale:
        return  # already written (validity is checked under the lock)
    need = sum(4 * shape.param_count(vocab) for shape in shapes)  # fp32
    free = free_bytes(out.parent)
    if free < 1.1 * need:
        raise DemoPairError(
            f"the cost-matched models need {need / 1e9:.1f} GB but {out.parent} has {free / 1e9:.1f} GB free; "
            "free space, pass smaller --target-scale/--draft-scale, or --no-cost-matched"
        )


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """Use `threads` torch threads inside the block (if given), restoring the caller's setting after."""
    if not threads:
        yield
        return
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _ensure_cost_matched(pair: DemoPair, key: str, target_scale: str, draft_scale: str, log) -> DemoPair:
    wanted = {"target_scale": target_scale, "draft_scale": draft_scale}
    have = pair.stats.get("cost_matched", {})
    if have and {k: have.get(k) for k in wanted} == wanted:
        return pair
    from .pipeline import COST_DIRS, build_cost_matched

    # First drop any old cost-matched models from the pair (and its marker), so that an interrupted build
    # below leaves a valid pair without them rather than a corrupt one.
    stats = {k: v for k, v in pair.stats.items() if k != "cost_matched"}
    for name in COST_DIRS:
        if (pair.root / name).exists():
            shutil.rmtree(pair.root / name)
    write_json_atomic(pair.root / "stats.json", stats)
    write_marker(pair.root, key)
    stats["cost_matched"] = {**wanted, **build_cost_matched(pair.root, stats, target_scale, draft_scale, log)}
    write_json_atomic(pair.root / "stats.json", stats)
    write_marker(pair.root, key)
    return DemoPair(pair.root, stats)
