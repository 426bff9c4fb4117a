"""A tiny random-weight Llama checkpoint in Hugging Face layout, for fast tests of everything above the model.

Shapes: vocab 49152 (the SmolLM2 tokenizer's), hidden 128, MLP 256, 2 layers, 8 query / 4 KV heads of dim 16,
so tensor-parallel sizes 1, 2 and 4 divide the heads. Weights are saved sharded into two safetensors files
with an index, exactly as `transformers` writes large checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.model.loader import default_model_path
from pipeline.model.tokenizer import Tokenizer

TINY_CONFIG = {
    "vocab_size": 49152,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def tiny_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face names; std 0.05 keeps logits spread so argmax is meaningful."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05 + mean

    sd = {
        "model.embed_tokens.weight": rand(config["vocab_size"], h) * 10,
        "model.norm.weight": rand(h, mean=1.0),
    }
    bias = config.get("model_type") == "qwen2"
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd |= {
            p + "input_layernorm.weight": rand(h, mean=1.0),
            p + "post_attention_layernorm.weight": rand(h, mean=1.0),
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(i, h),
            p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
        }
        if config.get("model_type") == "qwen3":  # per-head q/k RMSNorm weights
            sd |= {p + "self_attn.q_norm.weight": rand(d, mean=1.0), p + "self_attn.k_norm.weight": rand(d, mean=1.0)}
        if bias:
            sd |= {
                p + f"self_attn.{x}_proj.bias": rand(n_out) for x, n_out in (("q", q), ("k", kv), ("v", kv))
            }
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = rand(config["vocab_size"], h)
    return sd


def build_tiny_checkpoint(directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write config.json, two safetensors shards + index, tokenizer.json and tokenizer_config.json.

    `overrides` change config.json keys, e.g. `tie_word_embeddings=True`, or
    `architectures=["Qwen2ForCausalLM"], model_type="qwen2"` for a Qwen2-style model with q/k/v biases.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY_CONFIG, **overrides}
    sd = tiny_state_dict(config, seed)
    names = sorted(sd)
    halves = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for filename, part in halves.items():
        save_file({n: sd[n].contiguous() for n in part}, str(directory / filename), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, filename)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(config, indent=1))

    tok = Tokenizer.from_gguf(default_model_path())
    tok.hf.save(str(directory / "tokenizer.json"))
    tok_cfg = {
        "bos_token": tok.token_text(tok.bos_token_id),
        "eos_token": tok.token_text(tok.eos_token_ids[0]),
        "chat_template": tok.chat_template,
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    return directory
