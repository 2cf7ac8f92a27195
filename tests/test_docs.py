"""The configuration reference documents every option with its default, and the shipped configs are valid."""
from __future__ import annotations

import json
import pathlib

import pytest

from saguaro_vllm.frontend.config import SaguaroConfig, SaguaroOptions, parse_speculative_config

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
