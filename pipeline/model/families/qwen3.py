"""Qwen3 (dense): no q/k/v biases, an RMSNorm over each head of q and k before RoPE."""

from pipeline.model.families.family import Family

FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), qk_norm=True, gguf_architecture="qwen3")
