# The two Quickstart targets. Both create .venv when it is missing and work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The torch version lockstep is tested with (a CPU build on machines without CUDA).
TORCH  := torch==2.13.0

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

$(VENV)/.dev-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/digits.py --devices 2

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check src tests examples
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
