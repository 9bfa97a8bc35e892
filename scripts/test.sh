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

# The browser test (tests/test_web.py) drives Debian's chromium through chromedriver; it fails under CI=true
# when they are missing, so install them here when we can (root with apt-get), best effort.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "==> installing chromium and chromium-driver (apt-get)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium chromium-driver; } || echo "warning: could not install chromium + chromium-driver" >&2
  else
    echo "warning: chromium + chromium-driver missing and not installable here (needs root and apt-get)" >&2
  fi
fi

echo "==> ruff"
"$VENV/bin/python" -m ruff check app tests migrations

echo "==> mypy"
"$VENV/bin/python" -m mypy app

# Both pytest passes run on $LAYERCAST_TEST_WORKERS pytest-xdist worker processes (default 2, the cores of the
# CI machine; 0 runs in this process), each test file whole on one worker (--dist loadfile: its module-scoped
# fixtures, such as exported real models, are built once).
WORKERS=(-n "${LAYERCAST_TEST_WORKERS:-2}" --dist loadfile)

echo "==> pytest (${LAYERCAST_TEST_WORKERS:-2} workers)"
"$VENV/bin/python" -m pytest -q "${WORKERS[@]}" "$@"

# The API tests once more on PostgreSQL (127.0.0.1:5432, database `test`; tests/conftest.py gives each test
# its own database copied from a migrated template). Only on a full run (no pytest arguments); under
# CI=true an unreachable server fails these tests instead of skipping them.
if [ "$#" -eq 0 ]; then
  echo "==> pytest on PostgreSQL (API test packages, LAYERCAST_TEST_BACKEND=postgresql)"
  LAYERCAST_TEST_BACKEND=postgresql "$VENV/bin/python" -m pytest -q "${WORKERS[@]}" -m "not slow" \
    tests/test_app.py tests/hardware tests/measurements tests/estimates tests/predictions tests/graphs \
    tests/security/test_auth.py
fi
