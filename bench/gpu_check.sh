#!/usr/bin/env bash
# The GPU check in one call: Triton kernels vs torch references, the GPU runner (graphs, eager) vs the torch
# runner, batch-1 decode with and without CUDA graphs, a 512-prompt job vs transformers generate, and the
# quantized GEMMs against copy bandwidth and tensor-core peak (docs/gpu.md, "The device check").
# Random weights and prompts, built on the device: nothing to stage first. Results land in $OUT (default
# bench/out/gpu_check) section by section; the whole run is limited to 9 minutes.
#
#   bash bench/gpu_check.sh [--only kernels,runners,decode1,job,gemm]
#   bash bench/gpu_check.sh --dry-run      # tiny shapes on CPU under TRITON_INTERPRET=1, nothing timed
#
# Needs the project installed with a CUDA build of torch (and triton) and its test extras (transformers).
# PYTHON picks the interpreter (default: .venv/bin/python where it exists, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
if [[ " $* " == *" --dry-run "* ]]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
export OUT=${OUT:-bench/out/gpu_check} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# rows are written as they are measured: a run stopped by the limit keeps everything before it
exec timeout 540 "$python" bench/gpu_check.py "$@"
