# Two commands matter: `make demo` and `make test`. Both run setup first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m saguaro_vllm.cli demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

# Unit tests only (no vLLM engine start-ups).
test-fast: setup
	$(PY) -m pytest -q -m "not engine"

clean:
	rm -rf .venv build *.egg-info
