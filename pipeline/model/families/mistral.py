"""Mistral: the Llama layout with sliding-window attention on every layer (config.json `sliding_window`)."""

from pipeline.model.families.family import Family

FAMILY = Family("mistral", ("MistralForCausalLM",), sliding_window=True)
