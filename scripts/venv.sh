# Sourced by serve.sh and test.sh: creates the virtual environment $VENV (default .venv) with $PYTHON
# (default python3, must be >= 3.11) unless it exists. Runs in the repository root.
PYTHON="${PYTHON:-python3}"
VENV="${LAYERCAST_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "layercast needs Python >= 3.11 (set PYTHON=...)" >&2; exit 1; }
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
