"""Reading a Hugging Face model directory: config.json -> ModelConfig, safetensors read tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pipeline.model.config import ModelConfig
from pipeline.model.tokenizer import Tokenizer

# Hugging Face architectures that are this decoder: name -> (family name, whether q/k/v carry a bias).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "MistralForCausalLM": ("mistral", False),
    "Qwen2ForCausalLM": ("qwen2", True),
}
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs {path.name}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def config_from_hf(raw: dict, source: Path) -> ModelConfig:
    """ModelConfig from a parsed config.json; `source` names the file in errors."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"{source}: architectures={archs} is not supported; expected a Llama-family model "
            f"(one of {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    family, qkv_bias = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("attention_bias") and not qkv_bias:
        raise ValueError(f"{source}: attention_bias=true (a bias on o_proj too) is not supported")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    window = raw.get("sliding_window") if raw.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
    max_pos = int(raw.get("max_position_embeddings", 2048))
    if window is not None and window < max_pos:
        raise ValueError(f"{source}: sliding-window attention (sliding_window={window}) is not supported")
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
            attention_bias=qkv_bias,
            rope_scaling=scaling,
            architecture=family,
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
        self.config = config_from_hf(_read_json(config_file), config_file)
        self.name = self.path.name
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
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
