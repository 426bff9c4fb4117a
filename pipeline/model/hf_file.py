"""Reading a Hugging Face model directory: config.json -> ModelConfig, safetensors read tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline.model.config import ModelConfig, read_json
from pipeline.model.families import BY_HF_ARCHITECTURE
from pipeline.model.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


def config_from_hf(raw: dict, source: Path) -> ModelConfig:
    """ModelConfig from a parsed config.json; `source` names the file in errors."""
    archs = raw.get("architectures") or []
    family = next((BY_HF_ARCHITECTURE[a] for a in archs if a in BY_HF_ARCHITECTURE), None)
    if family is None:
        raise ValueError(
            f"{source}: architectures={archs} is not supported; expected a Llama-family model "
            f"(one of {sorted(BY_HF_ARCHITECTURE)})"
        )
    if raw.get("attention_bias") and not family.qkv_bias:
        raise ValueError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    if raw.get("use_sliding_window") and not family.sliding_window:
        raise ValueError(f"{source}: per-layer sliding-window attention (use_sliding_window=true, "
                         f"sliding_window={raw.get('sliding_window')}) is not supported for {family.name}")
    max_pos = int(raw.get("max_position_embeddings", 2048))
    window = raw.get("sliding_window") if family.sliding_window else None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{source}: sliding_window={window!r}; expected a positive integer or null")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        # transformers >= 5 writes rope settings as `rope_parameters`; older configs as rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        scaling = rope if rope.get("rope_type", "default") != "default" else raw.get("rope_scaling")
        return ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family.qkv_bias,
            rope_scaling=scaling,
            architecture=family.name,
            qk_norm=family.qk_norm,
            sliding_window=window if window is not None and window < max_pos else None,
        )
    except KeyError as e:
        raise ValueError(f"{source}: required key {e.args[0]!r} is missing") from e


class HFCheckpoint:
    """A Hugging Face model directory (config.json, *.safetensors, tokenizer.json)."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory)
        if not self.path.is_dir():
            raise FileNotFoundError(f"model directory {self.path} not found")
        config_file = self.path / "config.json"
        self.config = config_from_hf(read_json(config_file), config_file)
        self.name = self.path.name
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: has no 'weight_map' object")
            files = [self.path / f for f in dict.fromkeys(weight_map.values())]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors weights (and no {INDEX_FILE})")
        return files

    def load_tokenizer(self) -> Tokenizer:
        """The directory's tokenizer; raises when it can produce ids the model has no embedding for."""
        tok = Tokenizer.from_hf_dir(self.path)
        if tok.vocab_size > self.config.vocab_size:
            raise ValueError(
                f"{self.path / 'tokenizer.json'} has {tok.vocab_size} tokens but "
                f"{self.path / 'config.json'} says vocab_size={self.config.vocab_size}: tokenizer and model "
                "do not match (expected at most vocab_size tokens)"
            )
        return tok

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor in `dtype`) pairs read one at a time from the memory-mapped shards."""
        for file in self.files:
            try:
                handle = safe_open(str(file), framework="pt")
            except SafetensorError as e:  # a truncated or corrupt download
                raise ValueError(f"{file}: {e}") from None
            with handle as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, f.get_tensor(name).to(dtype)
