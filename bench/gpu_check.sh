#!/usr/bin/env bash
# Compile and check the Triton weight-only GEMMs on a real GPU, then time them at 8B-Llama decode shapes.
# Usage: bench/gpu_check.sh [--bandwidth-gbs 4800]   (writes $OUT/gpu_check.json when $OUT is set)
# Budget: under 5 minutes on an H200 (compilation ~1 min, 4 layers x 3 formats x 4 batch sizes timing).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
json_args=()
if [[ -n "${OUT:-}" ]]; then json_args=(--json "$OUT/gpu_check.json"); fi
exec timeout 290 python bench/gpu_check.py "${json_args[@]}" "$@"
