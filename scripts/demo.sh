#!/usr/bin/env bash
# Set up .venv if needed, then train the debug Llama-style model on 3 local gloo ranks
# with flexshard: progress bar, summary table, <dump folder>/{metrics.jsonl,loss.png},
# then print a sample from the model just trained.
# Usage: bash scripts/demo.sh [--nproc 4] [--config configs/moe_debug.toml]
#                             [--training.steps 20] [--parallelism.placement mixed] ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup.sh

# the config and dump folder this run uses (the last of each flag wins, as in the trainer)
config=configs/debug.toml
folder=""
for ((i = 1; i <= $#; i++)); do
  j=$((i + 1))
  case "${!i}" in
    --config=*) config="${!i#*=}" ;;
    --config) config="${!j}" ;;
    --job.dump_folder=*) folder="${!i#*=}" ;;
    --job.dump_folder) folder="${!j}" ;;
  esac
done
if [[ -z "$folder" ]]; then
  folder=$(.venv/bin/python -c 'import sys, tomllib
print(tomllib.load(open(sys.argv[1], "rb")).get("job", {}).get("dump_folder", "outputs/debug"))' "$config")
fi

if grep -q '^\[model\.moe\]' "$config"; then
  # a DeepSeek-style MoE has no Hugging Face twin: sample from the final DCP checkpoint
  # (saved once, at the last step; a fresh run, not a resume of an earlier one)
  .venv/bin/flexshard-train --nproc 3 --config "$config" --checkpoint.enable true \
    --checkpoint.resume false --checkpoint.interval 1000000000 "$@"
  last=$(ls -d "$folder"/checkpoint/step-* | grep -v '\.partial$' | sort -t- -k2 -n | tail -1)
  sample=(--checkpoint "$last" --config "$config")
else
  # a dense model: export a Hugging Face folder and sample from it
  .venv/bin/flexshard-train --nproc 3 --config "$config" --checkpoint.last_save_in_hf true "$@"
  sample=(--checkpoint "$folder/hf")
fi
echo "--- a sample from the model just trained (flexshard-generate ${sample[*]}):"
.venv/bin/flexshard-generate "${sample[@]}" --prompt "MENENIUS:" \
  --max-new-tokens 120 --temperature 0.8 --top-k 20
