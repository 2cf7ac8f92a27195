"""The configuration reference is the pydantic model's own text, with every option and default; the shipped
configs are valid."""
from __future__ import annotations

import json
import re
import pathlib

import pytest

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroOptions, parse_speculative_config
from saguaro_vllm.tools import config_doc

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", list(SaguaroOptions.model_fields))
def test_every_option_is_documented(name):
    text = (ROOT / "docs" / "configuration.md").read_text()
    field = SaguaroOptions.model_fields[name]
    row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")), None)
    assert row is not None, f"docs/configuration.md has no row for saguaro.{name}"
    if field.default is not None:
        default_cell = row.strip().strip("|").split(" | ")[2]  # | key | type | default | meaning |
        assert json.dumps(field.default) in default_cell or str(field.default) in default_cell, row


@pytest.mark.parametrize("name", list(SaguaroConfig.model_fields))
def test_top_level_keys_documented(name):
    assert f"| `{name}` |" in (ROOT / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    cfg = parse_speculative_config(json.loads(path.read_text()))[0]
    assert cfg.method == "saguaro"


def test_configuration_page_is_generated_from_the_model():
    """docs/configuration.md's option tables are what `python -m saguaro_vllm.tools.config_doc` writes."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert config_doc.current(page) == page, "run: python -m saguaro_vllm.tools.config_doc"


def test_a_changed_description_makes_the_page_stale(monkeypatch):
    page = (ROOT / "docs" / "configuration.md").read_text()
    monkeypatch.setattr(SaguaroOptions.model_fields["draft_cores"], "description", "a different text")
    assert config_doc.current(page) != page
    assert "| `draft_cores` | list of int or null | `null` | a different text |" in config_doc.render_block()


def test_type_column_reads_the_annotations():
    fields = SaguaroOptions.model_fields
    assert config_doc.type_text(fields["kv_cache_gb"].annotation) == 'float or `"auto"`'
    assert config_doc.type_text(fields["fanout"].annotation) == "list of int or null"
    assert config_doc.type_text(fields["cuda_graphs"].annotation) == 'bool or `"auto"`'


# ------------------------------------------------------------------------- size and links of the user docs

#: docs/*.md is what a user reads; developer reference lives in docs/dev/, lab notes in benchmarks/notes.md.
USER_DOCS_MAX_BYTES = 150_000
#: Markdown whose links must resolve: the README, every page under docs/, the benchmarks' README.
LINKED_PAGES = ["README.md", "benchmarks/README.md",
                *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]


def test_user_docs_stay_small():
    sizes = {p.name: p.stat().st_size for p in (ROOT / "docs").glob("*.md")}
    total = sum(sizes.values())
    assert total <= USER_DOCS_MAX_BYTES, (
        f"docs/*.md hold {total} bytes, more than {USER_DOCS_MAX_BYTES}: move developer reference to docs/dev/ "
        f"and lab notes to benchmarks/notes.md ({sorted(sizes.items(), key=lambda kv: -kv[1])})")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.+)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            seen[slug] = n + 1
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", LINKED_PAGES)
def test_links_resolve(page):
    """Every relative link of the page names a file of the checkout, and every `#anchor` a heading of it."""
    source = ROOT / page
    broken = []
    for link in _links(source):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (source.parent / target).resolve() if target else source
        if not path.exists():
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(link)
    assert not broken, f"{page}: links that lead nowhere: {broken}"


def test_docs_named_in_code_exist():
    """A `docs/....md` named in the package, scripts, benchmarks or tests is a file of the checkout."""
    missing = set()
    for pattern in ("saguaro_vllm/**/*.py", "scripts/*", "benchmarks/*.py", "benchmarks/*.sh", "tests/*.py",
                    "pyproject.toml", "Makefile"):
        for path in ROOT.glob(pattern):
            if path.is_file():
                for name in re.findall(r"\bdocs/[\w./-]*?\w\.md\b", path.read_text(errors="replace")):
                    if not (ROOT / name).exists():
                        missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)
