#!/usr/bin/env bash
# The engine on a GPU, end to end, in at most 5 minutes: bench/gpu/e2e.py (see its docstring
# and bench/README.md). `bench/gpu/e2e.sh --dry-run` proves it on CPU.
cd "$(dirname "$0")/../.." && exec "${PYTHON:-python3}" bench/gpu/e2e.py "$@"
