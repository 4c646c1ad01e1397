#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: make the venv $VENV with torch $TORCH and flexshard with
# its test and trainer extras, unless that is done already (`source scripts/setup.sh
# --functions` only defines find_python).
#   TORCH   torch release (default 2.13.0, the CPU build on this machine's disk; another
#           release is PyPI's CUDA build, several GB, which runs on the CPU)
#   PYVER   Python X.Y of the venv (default: python3), found on PATH or in pyenv
# The default venv is .venv; any other torch or Python gets .venvs/torch-<TORCH>[-py<PYVER>],
# so that no release ever replaces the default venv's torch.
TORCH=${TORCH:-2.13.0}
PYVER=${PYVER:-}
if [ "$TORCH" = 2.13.0 ] && [ -z "$PYVER" ]; then
  VENV=.venv
else
  VENV=.venvs/torch-$TORCH${PYVER:+-py$PYVER}
fi

find_python() {  # python3, or python$1 from PATH or pyenv's versions
  if [ -z "$1" ]; then echo python3; return; fi
  if "python$1" -c '' 2>/dev/null; then echo "python$1"; return; fi
  local candidate
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python"$1"; do
    if [ -x "$candidate" ]; then echo "$candidate"; return; fi
  done
  echo "setup.sh: no Python $1 here (neither python$1 on PATH nor in pyenv)" >&2
  return 1
}

setup_venv() {
  if ! { [ -x $VENV/bin/flexshard-train ] && [ -x $VENV/bin/flexshard-generate ] &&
         [ -x $VENV/bin/ruff ] && [ -x $VENV/bin/lint-imports ] && $VENV/bin/python -c \
           'import sys, torch, flexshard, pytest, hypothesis, matplotlib, safetensors, transformers
import tokenizers, tqdm, tiktoken, accelerate, lightning, pytorch_optimizer, heavyball, expecttest
sys.exit(torch.__version__.split("+")[0] != sys.argv[1])' "$TORCH" 2>/dev/null; }; then
    [ -x $VENV/bin/python ] || "$(find_python "$PYVER")" -m venv $VENV
    # torch pinned in every install, so that installing flexshard never pulls another build
    # (this constraint file also replaces any machine-wide pip constraint)
    mkdir -p $VENV/etc
    echo "torch==$TORCH" >$VENV/etc/torch-constraint.txt
    PIP_CONSTRAINT=$VENV/etc/torch-constraint.txt $VENV/bin/pip install "torch==$TORCH"
    PIP_CONSTRAINT=$VENV/etc/torch-constraint.txt $VENV/bin/pip install -e '.[test,train]'
  fi
}

[ "${1:-}" = --functions ] || setup_venv
