"""Qwen2 / Qwen2.5: biases on the q/k/v projections."""

from pipeline.model.families.family import Family

FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, gguf_architecture="qwen2")
