#!/usr/bin/env bash
# The README's test command: sets up .venv with pinned versions, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The pytest entry script (not `python -m pytest`) keeps the repo root off sys.path, so the
# source folder `kernels/` can never shadow a top-level package of that name.
exec .venv/bin/pytest -n 2 -q "$@"
