"""Model families: what a checkpoint architecture needs beyond the shared decoder (`pipeline.model.llama`).

Every family runs on the one decoder; a family only says which checkpoints are its own and which of the
decoder's switches it turns on. Adding a family is one file here defining a `Family`, listed in
`FAMILIES` below (docs/model.md, "Adding a family"). A family that needs a new kind of layer adds a
`ModelConfig` field and the decoder reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json `architectures` entries that are this family
    qkv_bias: bool = False  # q/k/v projections carry a bias (o_proj never does)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE
    # config.json's `sliding_window` applies to every layer. False: the family has no window, or only an
    # opt-in per-layer one (`use_sliding_window`, refused when set).
    sliding_window: bool = False


def _families() -> tuple[Family, ...]:
    from pipeline.model.families import llama, mistral, qwen2, qwen3

    return llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY


FAMILIES = _families()
BY_HF_ARCHITECTURE = {arch: f for f in FAMILIES for arch in f.hf_architectures}
