#!/usr/bin/env bash
# The README's test command: sets up .venv with pinned versions, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The pytest entry script (not `python -m pytest`) keeps the repo root off sys.path, so the
# source folder `kernels/` can never shadow a top-level package of that name.
# One BLAS/OpenMP thread per xdist worker (two workers on two cores).
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/pytest -n 2 -q "$@"
