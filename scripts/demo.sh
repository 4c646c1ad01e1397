#!/usr/bin/env bash
# Set up .venv if needed, then train the debug Llama-style model on 3 local gloo ranks
# with flexshard: progress bar, summary table, outputs/debug/{metrics.jsonl,loss.png}.
# Usage: bash scripts/demo.sh [--nproc 4] [--config configs/moe_debug.toml]
#                             [--training.steps 20] [--parallelism.placement mixed] ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup.sh

# the run also writes its final model as a Hugging Face folder, then writes a sample
folder=outputs/debug
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    --job.dump_folder=*) folder="${!i#*=}" ;;
    --job.dump_folder) j=$((i + 1)); folder="${!j}" ;;
  esac
done
.venv/bin/flexshard-train --nproc 3 --config configs/debug.toml \
  --checkpoint.last_save_in_hf true "$@"
echo "--- a sample from the model just trained (flexshard-generate --checkpoint $folder/hf):"
.venv/bin/flexshard-generate --checkpoint "$folder/hf" --prompt "MENENIUS:" \
  --max-new-tokens 120 --temperature 0.8 --top-k 20
