#!/usr/bin/env bash
# The README's test command: sets up .venv with pinned versions, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# `python -m pytest` from the repository root works too: the root holds no folder that shadows a package
# (tests/test_packaging.py); the entry script is used for the venv's own interpreter.
# One BLAS/OpenMP thread per xdist worker (two workers on two cores).
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/pytest -n 2 -q "$@"
