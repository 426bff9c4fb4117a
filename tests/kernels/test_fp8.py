"""FP8 W8A8: quantization error bounds and `torch._scaled_mm` against the float32 reference of the same
quantized product (runs wherever torch has the kernel; skipped where it does not)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_MAX, fp8_matmul, fp8_matmul_reference, quantize_fp8_rows, quantize_fp8_weight


def test_row_quantization_error_is_within_e4m3_rounding():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    q, scale = quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    back = q.float() * scale[:, None]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 in the normal range; the row max maps to 448 exactly.
    normal = w.abs() >= scale[:, None] * 2**-6
    assert ((back - w).abs() <= 2**-4 * w.abs() + 1e-12)[normal].all()
    assert torch.allclose(q.float().abs().amax(-1), torch.full((64,), FP8_MAX))


def test_zero_rows_do_not_divide_by_zero():
    q, scale = quantize_fp8_rows(torch.zeros(2, 32))
    assert torch.equal(q.float(), torch.zeros(2, 32)) and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_equals_reference_and_is_close_to_dense(dtype):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 256, generator=g).to(dtype), torch.randn(48, 256, generator=g) * 0.05
    wq, ws = quantize_fp8_weight(w)
    try:
        y = fp8_matmul(x, wq, ws)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm not available here: {e}")
    ref = fp8_matmul_reference(x, wq, ws)
    dense = x.float() @ w.T
    assert y.dtype == dtype and y.shape == (5, 48)
    # The kernel accumulates in float32 and rounds to bfloat16 at the end.
    assert (y.float() - ref).abs().max() <= 2**-7 * ref.abs().max()
    # The quantization itself: a few percent of the output scale, as e4m3 promises (~2^-4 per element).
    assert (ref - dense).abs().max() <= 0.1 * dense.abs().max()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_scaled_mm_is_asked_for_bfloat16_output(dtype, monkeypatch):
    """float16's range ends at 65504: the product comes back in bfloat16 (float32's range) and is cast to
    the model dtype after, whatever that dtype is. A stand-in `_scaled_mm` (float32 arithmetic) records
    what it was asked for."""
    asked = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        asked.append(out_dtype)
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 64, generator=g).to(dtype), torch.randn(16, 64, generator=g) * 0.05
    wq, ws = quantize_fp8_weight(w)
    y = fp8_matmul(x, wq, ws)
    assert asked == [torch.bfloat16] and y.dtype == dtype
    ref = fp8_matmul_reference(x, wq, ws)
    assert (y.float() - ref).abs().max() <= 2**-7 * ref.abs().max()
