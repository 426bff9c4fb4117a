"""Model families: what a checkpoint architecture needs beyond the shared decoder (`pipeline.model.llama`).

Every family runs on the one decoder; a family only says which checkpoints are its own and which of the
decoder's switches it turns on. Adding a family is one file here defining a `Family`, listed in
`FAMILIES` below (docs/model.md, "Adding a family"). A family that needs a new kind of layer adds a
`ModelConfig` field and the decoder reads it.
"""

from __future__ import annotations

from pipeline.model.families import llama, mistral, qwen2, qwen3
from pipeline.model.families.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY)
BY_HF_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.hf_architectures}
BY_GGUF_ARCHITECTURE = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}
