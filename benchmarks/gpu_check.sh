#!/usr/bin/env bash
# The prepared one-shot GPU check; see benchmarks/gpu_check.py and docs/gpu.md.
#   benchmarks/gpu_check.sh OUT [NPROC [ARGS...]]
# Runs as the GPU machine is: its own python3 (PYTHON= to choose another), this checkout
# on PYTHONPATH, no venv and no install; everything it writes goes under OUT.
# W = 1 on GPU 0 (about 3 minutes on one H200, by estimate), then, with NPROC > 1, the
# same under torchrun on NPROC GPUs. Each run is capped so the whole stays under 8
# minutes; the JSON and Markdown land in OUT (gpu_check_w1.*, gpu_check_wN.*) with the
# traces and logs. ARGS go to gpu_check.py (e.g. --dry-run: CPU/gloo, tiny shapes).
set -u
out=${1:?usage: benchmarks/gpu_check.sh OUT [NPROC [ARGS...]]}
nproc=${2:-1}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# torch's compile caches and the NCCL/gloo scratch of this run stay under OUT too
export TORCHINDUCTOR_CACHE_DIR="$out/cache/inductor" TRITON_CACHE_DIR="$out/cache/triton"
export TMPDIR="$out/cache/tmp"
mkdir -p "$TMPDIR"
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic GEMMs for the bitwise parity checks
status=0
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 240 "$python" -m benchmarks.gpu_check \
    "$out" "$@" 2>&1 | tee "$out/gpu_check_w1.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$nproc" -gt 1 ]; then
    timeout 220 "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
        -m benchmarks.gpu_check "$out" "$@" 2>&1 | tee "$out/gpu_check_w$nproc.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
