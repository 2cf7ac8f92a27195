"""The configuration reference is the pydantic model's own text, with every option and default; the shipped
configs are valid."""
from __future__ import annotations

import json
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
