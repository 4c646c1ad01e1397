#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: create .venv and install flexshard with its test and
# trainer extras, unless that is done already.
if ! { [ -x .venv/bin/flexshard-train ] && [ -x .venv/bin/flexshard-generate ] &&
       [ -x .venv/bin/ruff ] && [ -x .venv/bin/lint-imports ] && .venv/bin/python -c \
         'import flexshard, pytest, hypothesis, matplotlib, safetensors, transformers
import tokenizers, tqdm, tiktoken, accelerate, pytorch_optimizer, heavyball' \
         2>/dev/null; }; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # the CPU torch first, pinned, so that installing flexshard never pulls another build
  .venv/bin/pip install torch==2.13.0
  .venv/bin/pip install -e '.[test,train]'
fi
