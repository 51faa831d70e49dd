#!/usr/bin/env bash
# Creates .venv (if missing or stale) and installs the pinned stack plus this package (editable).
# Used by both README commands; safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.diffusers_nki_stamp
want=$(cat requirements-lock.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating virtual environment .venv"
  "$PY" -m venv .venv
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned requirements (torch==2.13.0 CPU, diffusers==0.42.1, ...)"
  .venv/bin/python -m pip install -q "pip==26.3"
  .venv/bin/python -m pip install -q -r requirements-lock.txt
  # setuptools prints build warnings even with -q: keep them in a log, shown only on failure
  .venv/bin/python -m pip install -q --no-deps -e . > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
  echo "$want" > "$stamp"
fi
