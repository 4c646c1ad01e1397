#!/usr/bin/env bash
# The GPU check's dry run (CPU/gloo, tiny shapes: W = 1, then torchrun at W = 2) as the lent
# GPU machine would run it: Python 3.12, torch 2.11.0 and only the packages that machine's
# image has, no venv of the project and no install of flexshard (the checkout on
# PYTHONPATH). The image is copied in .venvs/gpu-machine; the results go to OUT.
# Usage: bash scripts/gpu_dry_run.sh [OUT]   (default outputs/gpu_dry_run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-outputs/gpu_dry_run}

source scripts/setup.sh --functions
TORCH=2.11.0 PYVER=3.12 VENV=.venvs/gpu-machine
# the GPU machine's image (docs/gpu.md): nothing else may be importable there
image=("torch==$TORCH" numpy safetensors tokenizers tiktoken tqdm matplotlib
       transformers==5.17.0 accelerate==1.15.0)
if ! $VENV/bin/python -c 'import sys, torch, numpy, safetensors, tokenizers, tiktoken, tqdm
import matplotlib, transformers, accelerate
sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' "$TORCH" 2>/dev/null; then
  rm -rf $VENV
  "$(find_python $PYVER)" -m venv $VENV
  echo "torch==$TORCH" >$VENV/torch-constraint.txt
  PIP_CONSTRAINT=$VENV/torch-constraint.txt $VENV/bin/pip install "${image[@]}"
fi
rm -rf "$out"
PYTHON=$VENV/bin/python3 bash benchmarks/gpu_check.sh "$out" 2 --dry-run
