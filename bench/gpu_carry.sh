#!/usr/bin/env bash
# Build the folders bench/gpu_check.sh takes to the device (ignored by git; never commit them):
#   .gpu-carry-a/  the first half of the SmolLM2 GGUF
#   .gpu-carry-b/  the second half, its sha256, and the packages the device lacks, as wheels
# Versions are the ones pinned for this project. polars is not imported by the pipeline, so it stays
# behind (its 35 MB would not fit beside the model half).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
rm -rf .gpu-carry-a .gpu-carry-b
mkdir -p .gpu-carry-a .gpu-carry-b
"$python" -m pip download -q --no-deps -d .gpu-carry-b hydra-core==1.3.8 omegaconf==2.3.1 gguf==0.19.0
"$python" -m pip wheel -q --no-deps -w .gpu-carry-b antlr4-python3-runtime==4.9.3  # an sdist only: built here
# llguidance (imported by the engine) is compiled: its abi3 wheel for the device's Python and glibc.
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d .gpu-carry-b "llguidance==$("$python" -c 'import importlib.metadata as m; print(m.version("llguidance"))')"
model=$("$python" -c "from pipeline.model.loader import default_model_path as p; print(p())")
split -n 2 -d "$model" .gpu-carry-b/model.gguf.part-
mv .gpu-carry-b/model.gguf.part-00 .gpu-carry-a/
(cd .gpu-carry-b && sha256sum < "$model" | sed 's/-$/model.gguf/' > model.gguf.sha256)
du -sh .gpu-carry-a .gpu-carry-b
