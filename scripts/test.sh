#!/usr/bin/env bash
# Set up the venv if needed, lint (ruff, import contracts), then run the tests not marked slow.
# Usage: bash scripts/test.sh [--torch X.Y.Z] [--python X.Y] [pytest arguments]
#   e.g. bash scripts/test.sh -x tests/placements/test_placements.py
#        bash scripts/test.sh --torch 2.11.0 --python 3.12   # in .venvs/torch-2.11.0-py3.12
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

while [ $# -gt 0 ]; do
  case "$1" in
    --torch) TORCH=$2; shift 2 ;;
    --python) PYVER=$2; shift 2 ;;
    *) break ;;
  esac
done
source scripts/setup.sh

$VENV/bin/ruff check .
$VENV/bin/lint-imports --no-cache  # the one-way package dependencies in pyproject.toml
exec $VENV/bin/python -m pytest -m "not slow" "$@"
