"""Model shape and hyper-parameters, independent of the checkpoint format they came from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


def read_json(path: Path) -> dict:
    """A model directory's JSON file (config.json, tokenizer_config.json, ...); errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


# Quantization schemes of the linear layers and int4 group sizes (pipeline/model/quant.py): weight-only
# int8 / int4 / gguf, w8a8 (int8 weights and activations) and fp8 (FP8 W8A8, CUDA only). The job also takes
# "auto" (chosen by regime).
QUANT_SCHEMES = ("none", "int8", "int4", "gguf", "w8a8", "fp8")
QUANT_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class ModelConfig:
    """What the network needs to know to build itself (filled from GGUF metadata or HF config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Llama-3 style frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    architecture: str = "llama"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # every layer attends to the last this many positions only (Mistral)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise a clear error when `tp_size` cannot split the heads evenly."""
        if tp_size < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tp_size}")
        bad = [
            f"{name}={n}"
            for name, n in (("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads))
            if n % tp_size
        ]
        if bad:
            ok = [d for d in range(1, self.num_kv_heads + 1) if self.num_kv_heads % d == 0 and self.num_heads % d == 0]
            raise ValueError(
                f"tensor_parallel={tp_size} must divide the model's head counts ({', '.join(bad)}); "
                f"valid sizes: {ok}"
            )

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + emb + head + h
