# Quick start: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean chaos

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/elastic-runtime demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/run_all.py

# Multi-process chaos loop: random kill -9 / SIGSTOP of real worker processes, checked bitwise.
chaos: $(STAMP)
	$(BIN)/python tests/multiprocess/chaos.py --rounds $(or $(ROUNDS),10)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
