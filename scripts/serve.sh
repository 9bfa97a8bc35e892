#!/usr/bin/env bash
# Set up everything (or reuse .venv) and run the service on http://127.0.0.1:8000 with an embedded
# SQLite database (./var/layercast.db, migrated at start) and the predictor shipped in models/.
# No torch is installed for this. Usage: bash scripts/serve.sh [--host H] [--port P] [--reload]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV="${LAYERCAST_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "layercast needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

echo "==> installing layercast (API only, no torch)"
"$VENV/bin/python" -m pip install --quiet --no-input -e .

exec "$VENV/bin/layercast" serve "$@"
