"""model.quant=auto: the regime choice against the roofline worked out by hand for SmolLM2's shape."""

from __future__ import annotations

import pytest

from pipeline.model.config import ModelConfig
from pipeline.model.quant_choice import choose_quant
from pipeline.model.roofline import HardwareProfile

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, tie_word_embeddings=True)


def cpu(int8: float | None = 800e9) -> HardwareProfile:
    flops = {"fp32": 100e9, "bf16": 200e9} | ({} if int8 is None else {"int8": int8})
    return HardwareProfile("cpu", 20e9, flops, 16e9)


def test_weight_only_at_batch_one_w8a8_once_bf16_compute_bound():
    # int8 weights (~1 byte per weight) stay bandwidth-bound up to batch 800e9 / (2 * 20e9) = 20; the
    # bf16 weight-only step (~0.6 bytes per weight) turns compute-bound and slower than that from
    # batch ~ 1 byte * 200e9 / (2 * 20e9) = 5.
    choice = choose_quant(SMOLLM2, cpu(), "gguf", weight_only_kernels=True, max_batch=64)
    assert choice.scheme == "gguf" and choice.w8a8_rows in (5, 6) and choice.lm_head == "int8"
    assert "W8A8 from" in choice.reason


def test_no_weight_only_kernels_means_w8a8_everywhere():
    # Without fast weight-only kernels (AVX2-only CPUs) the weight-only linears dequantize to float32 every
    # call: > 8 bytes per weight.
    choice = choose_quant(SMOLLM2, cpu(), "int4", weight_only_kernels=False, max_batch=64)
    assert (choice.scheme, choice.w8a8_rows, choice.lm_head) == ("w8a8", 1, "int8")


@pytest.mark.parametrize("int8", [None, 1e9])
def test_no_or_slow_int8_keeps_weight_only(int8):
    choice = choose_quant(SMOLLM2, cpu(int8), "gguf", weight_only_kernels=True, max_batch=64)
    assert choice.scheme == "gguf" and choice.w8a8_rows is None
