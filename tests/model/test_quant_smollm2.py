"""quant=gguf on the real SmolLM2 Q4_1: the file's blocks, bit-exact, and the logits of the float path."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.gguf_file import GGUFCheckpoint
from pipeline.model.llama import FUSED_PARTS
from pipeline.model.loader import load_model
from pipeline.model.quant import QuantLinear, linear_weight_bytes
from tests.reference import prompt_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_model(smollm2_path):
    return load_model(smollm2_path, quant="gguf")


def test_linears_hold_the_files_blocks_bit_exact(gguf_model, smollm2_path):
    """Every linear's dequantized weight equals the gguf package's dequantization (Q/K un-permuted)."""
    modules = dict(gguf_model.model.named_modules())
    checked = 0
    for name, full in GGUFCheckpoint(smollm2_path).tensors(torch.float32):
        if not name.endswith("_proj.weight"):
            continue
        path, short = name.removeprefix("model.").rsplit(".", 2)[:2]
        fused, part = FUSED_PARTS.get(short, (short, 0))
        lin = modules[f"{path}.{fused}"]
        assert isinstance(lin, QuantLinear) and lin.bits == 4 and lin.mins is not None
        start, n = lin.local_rows(part)
        assert torch.equal(lin.dequantize()[start : start + n], full), name
        checked += 1
    assert checked == 7 * 30


def test_logits_match_float_path_and_bytes(gguf_model, smollm2_path):
    ref = load_model(smollm2_path)
    ids = gguf_model.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')

    assert (prompt_logits(gguf_model.model, ids) - prompt_logits(ref.model, ids)).abs().max().item() <= 1e-3

    ratio = linear_weight_bytes(gguf_model.model) / linear_weight_bytes(ref.model)
    assert ratio == pytest.approx(5 / 32)  # Q4_1: 32 weights in 16 + 2 + 2 bytes vs 128 bytes of float32
