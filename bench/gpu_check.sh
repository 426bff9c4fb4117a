#!/usr/bin/env bash
# The GPU check: Triton kernels vs torch references, greedy agreement with the CPU float32 engine, decode
# tok/s at batch 1/64/256 with and without CUDA graphs, GEMM throughput vs torch.matmul and HBM, and the
# 1,024-prompt job vs transformers generate; one summary table at the end. Budget: < 8 minutes on one H200.
#
#   bench/gpu_check.sh [--quick]     run (prints the table; with $OUT set, also $OUT/gpu_check.json and .log)
#   bench/gpu_check.sh --stage       only copy carried files to /tmp/gpu_check (first of two device calls)
#
# Packages the device lacks (hydra-core, omegaconf, antlr4, gguf, llguidance) and the SmolLM2 GGUF travel in
# .gpu-carry-a/ and .gpu-carry-b/, built here by bench/gpu_carry.sh (see docs/gpu.md); the model is
# 94 MiB, over one call's 64 MiB, so it comes in two halves over two calls to the same warm machine.
# GPU_CHECK_MODEL=/path/to/model.gguf uses a model already there instead.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
stage=/tmp/gpu_check
mkdir -p "$stage"
for dir in .gpu-carry-a .gpu-carry-b; do
    if [[ -d $dir ]]; then cp -n "$dir"/* "$stage"/; fi
done
if [[ "${1:-}" == "--stage" ]]; then ls -l "$stage"; exit 0; fi

shopt -s nullglob
packages=("$stage"/*.whl)
if (( ${#packages[@]} )); then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/gpu_check_site "${packages[@]}"
    export PYTHONPATH="/tmp/gpu_check_site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
parts=("$stage"/model.gguf.part-*)
if (( ${#parts[@]} )) && [[ ! -f $stage/model.gguf ]]; then
    cat "${parts[@]}" > "$stage/model.gguf"
    (cd "$stage" && sha256sum -c model.gguf.sha256) || { echo "gpu_check: model halves do not match"; rm -f "$stage/model.gguf"; }
fi
model=${GPU_CHECK_MODEL:-$stage/model.gguf}
args=(--model "$model" "$@")
if [[ -n "${OUT:-}" ]]; then args+=(--json "$OUT/gpu_check.json"); fi
export PYTHONUNBUFFERED=1
set -o pipefail
timeout 500 python3 bench/gpu_check.py "${args[@]}" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
