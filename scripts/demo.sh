#!/usr/bin/env bash
# Set up .venv if needed, then train a small transformer on local gloo ranks.
# Usage: bash scripts/demo.sh [--nproc 3] [--steps 30] [--placement mixed|shard0|owned|block|flat]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup.sh

exec .venv/bin/python -m flexshard.demo "$@"
