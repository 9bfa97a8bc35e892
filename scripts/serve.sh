#!/usr/bin/env bash
# Set up everything (or reuse .venv) and run the service on http://127.0.0.1:8000 with an embedded
# SQLite database (./var/layercast.db, migrated at start) and the predictor shipped in models/.
# No torch is installed for this. Usage: bash scripts/serve.sh [--host H] [--port P] [--reload]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/venv.sh
source scripts/venv.sh

echo "==> installing layercast (API only, no torch)"
"$VENV/bin/python" -m pip install --quiet --no-input -e .

exec "$VENV/bin/layercast" serve "$@"
