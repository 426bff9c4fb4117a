"""What a model family declares (one instance per file in this package)."""

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
    gguf_architecture: str | None = None  # GGUF `general.architecture` of this family (None: not read)
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q/K rows for its RoPE layout (llama only)
