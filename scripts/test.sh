#!/usr/bin/env bash
# Set up everything from scratch (or reuse .venv) and run the full test suite: ruff, mypy, pytest.
# Usage: bash scripts/test.sh [extra pytest args]
# Exit status: non-zero on any failure, including pytest's 5 ("no tests collected").
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

echo "==> installing layercast with the train and dev extras (torch==2.13.0)"
"$VENV/bin/python" -m pip install --quiet --no-input -e '.[train,dev]'

echo "==> ruff"
"$VENV/bin/python" -m ruff check app tests migrations

echo "==> mypy"
"$VENV/bin/python" -m mypy app

echo "==> pytest"
exec "$VENV/bin/python" -m pytest -q "$@"
