#!/usr/bin/env bash
# Set up everything from scratch (or reuse .venv) and run the full test suite: ruff, mypy, pytest.
# Usage: bash scripts/test.sh [extra pytest args]
# Exit status: non-zero on any failure, including pytest's 5 ("no tests collected").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/venv.sh
source scripts/venv.sh

echo "==> installing layercast with the train and dev extras (torch==2.13.0)"
"$VENV/bin/python" -m pip install --quiet --no-input -e '.[train,dev]'

echo "==> ruff"
"$VENV/bin/python" -m ruff check app tests migrations

echo "==> mypy"
"$VENV/bin/python" -m mypy app

echo "==> pytest"
exec "$VENV/bin/python" -m pytest -q "$@"
