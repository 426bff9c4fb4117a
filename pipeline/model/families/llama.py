"""Llama (1, 2, 3, 3.x; SmolLM2 and other Llama-architecture models): the plain decoder."""

from pipeline.model.families.family import Family

FAMILY = Family("llama", ("LlamaForCausalLM",), gguf_architecture="llama", gguf_permuted_qk=True)
