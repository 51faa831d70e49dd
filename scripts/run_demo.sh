#!/usr/bin/env bash
# The README's main job: sets up .venv with pinned versions, then runs the streaming demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/diffusers-nki demo "$@"
