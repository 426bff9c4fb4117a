"""Reading a GGUF checkpoint: metadata -> ModelConfig, tensors -> Hugging Face names and layout.

`gguf_format.GGUFFile` parses the container (memory-mapped); the `gguf` package dequantizes every block
format it knows (F32/F16/BF16, Q4_0/Q4_1/Q8_0, K-quants) and is the bit-exact reference. The raw
quantized blocks stay reachable through `GGUFCheckpoint.raw` / `raw_hf_tensors` so a quantized linear
can be built from them without re-quantizing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from pipeline.model.config import ModelConfig
from pipeline.model.families import BY_GGUF_ARCHITECTURE
from pipeline.model.gguf_format import GGUFFile
from pipeline.model.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class RawTensor(NamedTuple):
    """A tensor exactly as stored: `blocks` is uint8 [rows, bytes per row] for block formats (plain
    float arrays for F32/F16), `qtype` its format, `shape` the logical (rows, cols) torch shape."""

    blocks: np.ndarray
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]


def hf_name(gguf_name: str) -> str:
    """Hugging Face name of a GGUF tensor name (e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(f"GGUF tensor {gguf_name!r} has no place in a Llama model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk_rows(rows: np.ndarray | torch.Tensor, num_heads: int):
    """Undo llama.cpp's Q/K row permutation along axis 0.

    llama.cpp's converter reorders each head's rows from the rotate-half layout (first halves, then
    second halves) to interleaved pairs (x0, x_{D/2}, x1, x_{D/2+1}, ...). Rows are whole rows of the
    matrix, so the same reordering applies to dequantized weights, biases and raw quantized block rows.
    `num_heads` is the query head count for Q and the KV head count for K.
    """
    shape = tuple(rows.shape)
    half = shape[0] // num_heads // 2
    split = rows.reshape(num_heads, half, 2, *shape[1:])
    swapped = split.swapaxes(1, 2) if isinstance(rows, np.ndarray) else split.transpose(1, 2)
    return swapped.reshape(shape)


class GGUFCheckpoint:
    """An open GGUF file: its ModelConfig, tokenizer, dequantized tensors and raw blocks."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF checkpoint {self.path} not found")
        self.file = GGUFFile(self.path)
        self._tensors = self.file.tensors
        self.config = self._read_config()
        self.name = self.path.stem

    def _field(self, key: str, default=None):
        return self.file.metadata.get(key, default)

    def _read_config(self) -> ModelConfig:
        arch = self._field("general.architecture")
        family = BY_GGUF_ARCHITECTURE.get(arch)
        if family is None:
            raise ValueError(
                f"{self.path}: architecture {arch!r} is not supported; expected a Llama-family model "
                f"(general.architecture in {sorted(BY_GGUF_ARCHITECTURE)})"
            )
        self.family = family

        def need(key: str):
            value = self._field(f"{arch}.{key}")
            if value is None:
                raise ValueError(f"{self.path}: metadata key {arch}.{key} is missing")
            if not isinstance(value, int | float):
                raise ValueError(f"{self.path}: {arch}.{key}={value!r} (per-layer values are not supported)")
            return value

        hidden, heads = need("embedding_length"), need("attention.head_count")
        head_dim = self._field(f"{arch}.attention.key_length", hidden // heads)
        rot_dim = self._field(f"{arch}.rope.dimension_count", head_dim)
        if rot_dim != head_dim:
            raise ValueError(f"{self.path}: partial rotary ({rot_dim} of {head_dim} dims) is not supported")
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(
                f"{self.path}: rope_freqs (Llama-3.1 style RoPE scaling in GGUF) is not supported; "
                "load the Hugging Face checkpoint instead"
            )
        scaling = None
        kind = self._field(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(self._field(f"{arch}.rope.scaling.factor"))}
        elif kind != "none":
            raise ValueError(
                f"{self.path}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear)"
            )
        vocab = self._field(f"{arch}.vocab_size") or len(self._field("tokenizer.ggml.tokens", []))
        attn_bias = "blk.0.attn_q.bias" in self._tensors
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=int(heads),
            num_kv_heads=int(self._field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(head_dim),
            rope_theta=float(self._field(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias=attn_bias,
            rope_scaling=scaling,
            architecture=family.name,
            qk_norm=family.qk_norm,
        )

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf(self.path, metadata=self.file.metadata)

    def raw(self, name: str) -> RawTensor:
        """The tensor `name` (GGUF naming) as stored in the file, without any permutation undone."""
        info = self._tensors[name]
        return RawTensor(self.file.blocks(name), info.qtype, info.shape)

    def _qk_heads(self, name: str) -> int | None:
        """Heads to un-permute over for a Q or K tensor of a family llama.cpp permuted, else None."""
        if not self.family.gguf_permuted_qk:
            return None
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        return {"attn_q": self.config.num_heads, "attn_k": self.config.num_kv_heads}.get(kind)

    def raw_hf_tensors(self) -> Iterator[tuple[str, RawTensor]]:
        """(Hugging Face name, raw tensor) pairs with Q/K block rows already put back in HF order."""
        for name in self._tensors:
            raw = self.raw(name)
            heads = self._qk_heads(name)
            if heads is not None:
                raw = raw._replace(blocks=unpermute_qk_rows(raw.blocks, heads))
            yield hf_name(name), raw

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, dequantized tensor in `dtype`) pairs, one tensor in memory at a time."""
        from gguf.quants import dequantize

        for name, raw in self.raw_hf_tensors():
            try:
                values = dequantize(raw.blocks, raw.qtype)
            except NotImplementedError as e:
                raise ValueError(f"{self.path}: tensor {name}: {e}") from e
            values = values.reshape(raw.shape)
            if not values.flags.writeable:  # F32 tensors are views of the read-only memory map
                values = values.copy()
            yield name, torch.from_numpy(values).to(dtype)
