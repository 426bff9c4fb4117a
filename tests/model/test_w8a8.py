"""W8A8 linears and per-call kernel choice on the tiny model, against plain-torch references."""

from __future__ import annotations

import pytest
import torch

from kernels.w8a8_reference import w8a8_matmul_reference
from kernels.wq_reference import quantize_int8, wq_matmul_reference
from pipeline.model.layers import LMHead
from pipeline.model.loader import load_model
from pipeline.model.quant import (
    MAX_COPIES,
    KernelChoice,
    QuantLinear,
    QuantLMHead,
    attach_w8a8,
    column_copies,
    final_hidden_absmax,
)
from tests.reference import prompt_logits

IDS = [1, 504, 3459, 314, 260, 1789, 28, 1017, 7, 42, 9000, 17]


def _logits(loaded, ids):
    return prompt_logits(loaded.model, ids)


@pytest.fixture(scope="module")
def tiny_float(tiny_model_dir):
    return load_model(tiny_model_dir)


def test_w8a8_linear_equals_reference_from_float_weight(tiny_model_dir, tiny_float):
    q = load_model(tiny_model_dir, quant="w8a8")
    lin = q.model.layers[1].mlp.down_proj
    ref_weight = tiny_float.model.layers[1].mlp.down_proj.weight
    assert isinstance(lin, QuantLinear) and lin.choice.uses_w8a8(1)
    x = torch.randn(7, lin.in_features)
    expected = w8a8_matmul_reference(x, *quantize_int8(ref_weight))
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("lm_head", ["int8", "bf16", "none"])
def test_w8a8_tiny_model_close_to_float(tiny_model_dir, tiny_float, lm_head):
    ref = _logits(tiny_float, IDS)
    q = load_model(tiny_model_dir, quant="w8a8", quant_lm_head=lm_head)
    assert isinstance(q.model.lm_head, QuantLMHead) == (lm_head != "none")
    assert torch.equal(q.model.lm_head.weight, tiny_float.model.lm_head.weight)  # the float head is kept
    out = _logits(q, IDS)
    assert (out - ref).norm() / ref.norm() < 0.05  # int8 alone (quant=int8, weights only) stays under 0.02
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
    assert q.model.kernel_choice.steps == {"w8a8": 1}


def test_weight_only_switches_to_w8a8_from_a_batch_size(tiny_model_dir):
    exact = load_model(tiny_model_dir, quant="int4", quant_group_size=32).model.layers[0].self_attn.qkv_proj
    q = load_model(tiny_model_dir, quant="int4", quant_group_size=32, w8a8_rows=4)
    lin = q.model.layers[0].self_attn.qkv_proj
    small, large = torch.randn(3, lin.in_features), torch.randn(4, lin.in_features)
    ref_small = wq_matmul_reference(small, exact.qweight, exact.scales, exact.mins, 4)
    # Packed for torch's CPU kernels where bf16 is native: bfloat16 activations, else the exact path.
    tol = 2**-7 if lin.cpu_packed is not None else 1e-6
    torch.testing.assert_close(lin(small), ref_small, rtol=tol, atol=tol * ref_small.abs().max().item())
    expected = w8a8_matmul_reference(large, *quantize_int8(exact.dequantize()))  # requantized per channel
    torch.testing.assert_close(lin(large), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    _logits(q, IDS)  # 12 rows: W8A8
    _logits(q, IDS[:2])  # 2 rows: weight-only
    assert q.model.kernel_choice.steps == {"w8a8": 1, "int4": 1}
    assert isinstance(q.model.lm_head, QuantLMHead)


def test_int8_w8a8_layout_shares_the_weight(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="int8", w8a8_rows=16)
    lin = q.model.layers[0].mlp.gate_up_proj
    weight = lin.qweight if lin.cpu_packed is None else lin.cpu_packed.weight
    assert lin.w8a8_weight.data_ptr() == weight.data_ptr()


def test_bf16_lm_head_matches_bfloat16_matmul(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="bf16")
    h = torch.randn(5, q.config.hidden_size)
    w = q.model.lm_head.weight
    expected = (h.bfloat16().float() @ w.bfloat16().float().T)
    torch.testing.assert_close(q.model.lm_head(h), expected, rtol=2**-7, atol=1e-2)


def test_without_w8a8_rows_nothing_changes(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="int8")
    assert type(q.model.lm_head) is LMHead and q.model.layers[0].mlp.down_proj.w8a8_weight is None
    _logits(q, IDS)
    assert q.model.kernel_choice.steps == {"int8": 1}


def test_bad_w8a8_rows(tiny_model_dir):
    q = load_model(tiny_model_dir, quant="int8")
    with pytest.raises(ValueError, match="w8a8_rows must be >= 1"):
        attach_w8a8(q.model, "int8", 0, lm_head="none")
    with pytest.raises(ValueError, match="quant_lm_head='fp8'"):
        attach_w8a8(q.model, "int8", 4, lm_head="fp8")


def test_column_copies_split_only_the_outlier_channels():
    absmax = torch.tensor([1.0, 60.0, 2.0, 9.5, 3.0, 0.5, 10.0, 2.5])
    copies = column_copies(absmax, outliers=3)
    # the 3 largest (60, 10, 9.5) over the 4th (3.0): 20 capped, ceil(3.3), ceil(3.2); the rest one
    assert MAX_COPIES < 20
    assert copies.tolist() == [1, MAX_COPIES, 1, 4, 1, 1, 4, 1]
    assert column_copies(torch.full((8,), 2.0), outliers=3).tolist() == [1] * 8  # nothing stands out
    assert column_copies(torch.zeros(8), outliers=3).tolist() == [1] * 8
    assert column_copies(absmax, outliers=8).tolist() == [1] * 8  # no channel left to compare with


def test_split_int8_head_is_the_w8a8_product_of_the_split_columns_and_beats_plain_int8():
    torch.manual_seed(0)
    vocab, hidden = 512, 64
    head = LMHead(vocab, hidden)
    head.weight.data.normal_()
    x = torch.randn(16, hidden)
    x[:, 5] *= 40  # outlier channels, as a final hidden state has them
    x[:, 9] *= 25
    copies = column_copies(x.abs().amax(0), outliers=4)
    split = QuantLMHead(head, KernelChoice("", 1), "int8", copies)
    plain = QuantLMHead(head, KernelChoice("", 1), "int8")
    columns = torch.repeat_interleave(torch.arange(hidden), copies)
    q, s = quantize_int8(head.weight.data)
    expected = w8a8_matmul_reference(x[:, columns] / copies[columns], q[:, columns], s)
    torch.testing.assert_close(split(x), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # the activations' share of the error: against the int8 weights with float activations
    exact = x @ (q.float() * s).T
    split_err, plain_err = (split(x) - exact).norm(), (plain(x) - exact).norm()
    assert split_err < plain_err / 3


def test_loaded_int8_head_splits_the_calibrated_channels_the_same_way_every_load(tiny_model_dir):
    first = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8").model
    second = load_model(tiny_model_dir, quant="w8a8", quant_lm_head="int8").model
    # the calibration pass (through the loaded W8A8 body) is seeded: the same columns every load
    torch.testing.assert_close(final_hidden_absmax(first), final_hidden_absmax(second), rtol=0, atol=0)
    copies = column_copies(final_hidden_absmax(first))
    assert torch.equal(first.lm_head.columns, torch.repeat_interleave(torch.arange(copies.numel()), copies))
    assert torch.equal(first.lm_head.columns, second.lm_head.columns)
    assert first.lm_head.columns.numel() > first.config.hidden_size  # the tiny model has outliers to split
