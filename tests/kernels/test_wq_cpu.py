"""torch's CPU weight-only kernels behind our format, and the device dispatcher's CPU path."""

from __future__ import annotations

import pytest
import torch

from kernels.dispatch import packed_matmul, wq_matmul
from kernels.wq_cpu import cpu_matmul, cpu_supports, pack_for_cpu
from kernels.wq_reference import dequantize, quantize_int4, quantize_int8, wq_matmul_reference


def _data(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)


def _bf16_scale_weights(q, s, mins):
    """The weight the int4 CPU kernel really uses: scale and zero = min + 8 scale rounded to bfloat16."""
    sb = s.float().bfloat16().float()
    zb = (s.float() * 8 + mins.float()).bfloat16().float()
    return dequantize(q, sb, zb - 8 * sb, 4)


@pytest.mark.parametrize("m,g", [(1, 32), (5, 64), (16, 128)])
def test_int4_cpu_kernel_matches_reference(m, g):
    w, x = _data(m, 48, 256, seed=g)
    q, s, mins = quantize_int4(w, g)
    y = cpu_matmul(x.bfloat16(), pack_for_cpu(q, s, mins, 4))
    xb = x.bfloat16().float()
    # Against the weights with bf16-rounded scales: only accumulation/output rounding remains.
    exact = xb @ _bf16_scale_weights(q, s, mins).T
    assert (y.float() - exact).abs().max() <= 2**-7 * 4 * exact.abs().max()
    # Against the float32 reference: the bf16 scale rounding is the only extra error.
    ref = wq_matmul_reference(xb, q, s, mins, 4)
    assert (y.float() - ref).abs().max() <= 2**-6 * 4 * ref.abs().max()


def test_int8_cpu_kernel_matches_reference():
    w, x = _data(7, 40, 96, seed=1)
    q, s = quantize_int8(w)
    y = cpu_matmul(x.bfloat16(), pack_for_cpu(q, s, None, 8))
    ref = wq_matmul_reference(x.bfloat16().float(), q, s, None, 8)
    assert (y.float() - ref).abs().max() <= 2**-6 * 4 * ref.abs().max()


def test_support_rules_and_errors():
    w, x = _data(2, 16, 64)
    q8g, s8g = quantize_int8(w, 32)
    assert not cpu_supports(q8g, s8g, None, 8)  # grouped int8 (GGUF Q8_0): no torch CPU kernel
    with pytest.raises(ValueError, match="no torch CPU kernel"):
        pack_for_cpu(q8g, s8g, None, 8)
    q, s, mins = quantize_int4(w, 32)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_matmul(x, pack_for_cpu(q, s, mins, 4))
    y = packed_matmul(x, pack_for_cpu(q, s, mins, 4))  # float32 in, cast around the kernel
    assert y.dtype == torch.float32 and y.shape == (2, 16)
    q12, s12, m12 = quantize_int4(w[:12], 32)
    assert not cpu_supports(q12, s12, m12, 4)  # N = 12 is not a multiple of 16


def test_dispatch_cpu_is_the_dequantized_reference():
    w, x = _data(3, 24, 64, seed=5)
    q, s, mins = quantize_int4(w, 32)
    y = wq_matmul(x, q, s, mins, 4)
    assert torch.allclose(y, wq_matmul_reference(x, q, s, mins, 4), atol=1e-5, rtol=0)
