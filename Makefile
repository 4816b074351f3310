# Two entry points for a fresh machine: `make train` and `make test` (both set up first).
# Without CUDA, torch is pinned to the 2.13.0 CPU build so no multi-GB CUDA wheels are pulled.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.plait-installed

.PHONY: setup train test lint format bench

$(STAMP): pyproject.toml
	@echo "plait: installing torch and plait into $(VENV) (first time only; pip is quiet for a minute or two)"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q 'torch>=2.6'; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(VENV)/bin/plait train --dp 2 --out runs/default --overwrite

lint: setup
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

format: setup
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

test: lint
	$(PY) -m pytest

bench: setup
	$(PY) benchmarks/bench_single.py
	$(PY) benchmarks/bench_dp.py
	$(PY) benchmarks/bench_tp.py
	$(PY) benchmarks/bench_pp.py
	$(PY) benchmarks/bench_zero.py
	$(PY) benchmarks/bench_ckpt.py
