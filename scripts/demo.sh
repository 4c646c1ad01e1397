#!/usr/bin/env bash
# Set up .venv if needed, then train the debug Llama-style model on 3 local gloo ranks
# with flexshard: progress bar, summary table, outputs/debug/{metrics.jsonl,loss.png}.
# Usage: bash scripts/demo.sh [--nproc 4] [--config configs/moe_debug.toml]
#                             [--training.steps 20] [--parallelism.placement mixed] ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup.sh

exec .venv/bin/flexshard-train --nproc 3 --config configs/debug.toml "$@"
