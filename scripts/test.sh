#!/usr/bin/env bash
# Set up .venv if needed, lint, then run the tests not marked slow.
# Usage: bash scripts/test.sh [pytest arguments, e.g. -x tests/test_placements.py]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# skip the set-up when flexshard is installed (editable) with its test extras
if ! { [ -x .venv/bin/flexshard-demo ] && [ -x .venv/bin/ruff ] &&
       .venv/bin/python -c 'import flexshard, pytest, hypothesis' 2>/dev/null; }; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # the CPU torch first, pinned, so that installing flexshard never pulls another build
  .venv/bin/pip install torch==2.13.0
  .venv/bin/pip install -e '.[test]'
fi

.venv/bin/ruff check .
exec .venv/bin/python -m pytest -m "not slow" "$@"
