# Two commands matter: `make demo` and `make test`. Both run setup first (idempotent).
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m saguaro_vllm.tools.cli demo

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

# Unit tests only (no vLLM engine start-ups).
test-fast: setup
	$(PY) -m pytest -q -m "not engine"

# Every case of benchmarks/cases.json, the depth ceiling, the verification curve, every engine at real
# vocabularies, the drafter's host overhead, every engine under `vllm bench serve` (concurrency 1-64, two
# datasets, T=0 and 0.7), the GPU projection (traces, validation, cost models; several more hours on 2 cores) and
# the cost-regimes matrix (benchmarks/regimes.py), then docs/benchmarks.md and plots.
# The date that names this run's result files and trace directories, fixed when make starts and passed to the
# scripts (benchmarks/run.py: run_date), so a run that crosses midnight finds the files its earlier steps wrote.
BENCH_DATE := $(or $(BENCH_DATE),$(shell date +%F))
BENCH_CASES ?= cost-matrix temperature per-row-backup batch-sweep-32-64 cost-equal-cores raw-b1 sweep-scale sweep-scale-top-f1 finish-predraft
bench: export BENCH_DATE := $(BENCH_DATE)
bench: setup
	for c in $(BENCH_CASES); do $(PY) benchmarks/run.py --case $$c || exit 1; done
	$(PY) benchmarks/ceiling.py
	$(PY) benchmarks/verify_curve.py --depths 0,1,2,3,5,8
	$(PY) benchmarks/bench_transport.py --vocabs 128256,151936 --batches 1,16,64 --temperatures 0,1 \
		--engines vllm-ar,vllm-draft_model,saguaro-sync,saguaro-async --max-tokens 96 --max-num-seqs 1024 --label real-vocab
	$(PY) benchmarks/bench_host_overhead.py --label greedy
	$(PY) benchmarks/bench_host_overhead.py --batches 1,16 --budgets 0,8 --temperatures 1 --rounds 4 --label sampled-128k
	$(PY) benchmarks/bench_serve.py --label matrix
	$(PY) benchmarks/verify_curve.py --batch-sizes 1,4,16 --depths 0,1,3,5 --max-tokens 48
	$(PY) benchmarks/validate_projection.py --batch-sizes 1,4,16 --temperatures 0,0.7,1.0 --max-tokens 256 \
		--traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1b4b16-256 --ar-batch-sizes 1,4,16 \
		--verify-curve benchmarks/results/$(BENCH_DATE)-verify-curve.json --name validate-projection-b1b4b16-256
	$(PY) benchmarks/validate_projection.py --batch-sizes 1,4,16 --temperatures 0,0.7,1.0 --max-tokens 256 \
		--traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1b4b16-256-repeat --record-only
	$(PY) benchmarks/repeatability.py --traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1b4b16-256 \
		benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1b4b16-256-repeat \
		--validation benchmarks/results/$(BENCH_DATE)-validate-projection-b1b4b16-256.json
	$(PY) benchmarks/validate_projection.py --batch-sizes 1 --modes async --temperatures 0,0.7,1.0 --k 8 \
		--max-tokens 256 --traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1-256-k8 --record-only
	$(PY) benchmarks/gpu_cost_models.py
	$(PY) benchmarks/project_gpu.py --traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1b4b16-256 \
		--trace-glob 'async-b1-*/trace-*.jsonl.gz'
	$(PY) benchmarks/project_gpu.py --traces benchmarks/results/traces/$(BENCH_DATE)-demo-pair-b1-256-k8 \
		--trace-glob 'async-b1-*/trace-*.jsonl.gz' --label gpu-k8
	$(PY) benchmarks/regimes.py --repeats 3
	$(PY) benchmarks/report.py

clean:
	rm -rf .venv build *.egg-info
