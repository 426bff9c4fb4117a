"""Llama-family decoder, its configuration, loaders and quantized linears."""
