"""`make bench` (the Makefile's bench target): every benchmark behind docs/benchmarks.md runs before the report,
and the date naming the run's files is computed once."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{target}:(?!\s*export)", line))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _step(recipe: list[str], script: str) -> int:
    return next(i for i, line in enumerate(recipe) if script in line)


def test_bench_runs_the_regime_matrix_before_the_report():
    recipe = _recipe("bench")
    assert _step(recipe, "benchmarks/regimes.py") < _step(recipe, "benchmarks/report.py")
    assert recipe[-1] == "$(PY) benchmarks/report.py"


def test_bench_date_is_computed_once():
    text = (ROOT / "Makefile").read_text()
    assert len(re.findall(r"date \+%F", text)) == 1
    assert re.search(r"^BENCH_DATE := \$\(or \$\(BENCH_DATE\),\$\(shell date \+%F\)\)$", text, re.M)
    assert "bench: export BENCH_DATE := $(BENCH_DATE)" in text
