#!/usr/bin/env bash
# Set up .venv if needed, lint (ruff, import contracts), then run the tests not marked slow.
# Usage: bash scripts/test.sh [pytest arguments, e.g. -x tests/placements/test_placements.py]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup.sh

.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache  # the one-way package dependencies in pyproject.toml
exec .venv/bin/python -m pytest -m "not slow" "$@"
