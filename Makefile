# The Quickstart targets. Each creates .venv when it is missing and works on a fresh clone.
#   make test   lint + every tier collected + the unit and 2-rank tiers (tests/unit, tests/dist): under 5 minutes on 2 cores
#   make check  lint + every tier (unit, dist, e2e, cluster, gpu); GPU tests skip without a GPU. CI runs it.
# `make test TORCH=2.14.1` (or check) runs on another torch, in its own .venv-torch2.14.1.
PYTHON ?= python3
# The torch version lockstep is tested with by default (a CPU build on machines without CUDA).
DEFAULT_TORCH := 2.13.0
TORCH  ?= $(DEFAULT_TORCH)
VENV   := $(if $(filter $(DEFAULT_TORCH),$(TORCH)),.venv,.venv-torch$(TORCH))
BIN    := $(VENV)/bin

.PHONY: demo test check lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.demo-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==$(TORCH)
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

$(VENV)/.dev-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==$(TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.demo-installed
	rm -rf runs/digits  # the demo's own output: a fit refuses a folder that holds another run's later checkpoints
	$(BIN)/python examples/digits.py --devices 2

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/lint-imports

# Every tier collected first: a test file that fails to import (or shares a name with another tier's) ends `make test` too.
test: lint
	@out=$$($(BIN)/python -m pytest --collect-only -q tests 2>&1) || { echo "$$out" | tail -40; exit 1; }
	$(BIN)/python -m pytest tests/unit tests/dist

# Two passes (tests/conftest.py): the tests on two workers, then those marked `alone`, one at a time.
check: lint
	$(BIN)/python -m pytest -n 2 --dist load -m "not alone" tests; first=$$?; \
	$(BIN)/python -m pytest -m alone tests; second=$$?; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]

clean:
	rm -rf .venv .venv-torch* .mypy_cache .ruff_cache .pytest_cache
