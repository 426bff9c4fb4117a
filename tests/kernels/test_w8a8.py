"""W8A8 kernels against the plain-torch reference (`kernels.w8a8_reference`, exact integer sums).

The CPU path (`torch._int_mm`) and the Triton GEMM (under TRITON_INTERPRET=1, small shapes) must equal the
reference up to float32 rounding of the scaled result; the reference itself must stay within the
quantization error bound of the float product.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.dispatch import w8a8_matmul
from kernels.w8a8_reference import quantize_rows, w8a8_matmul_reference
from kernels.wq_reference import quantize_int8

SHAPES = [(1, 40, 96), (3, 70, 160), (17, 33, 192), (33, 16, 256), (64, 96, 576)]


def _inputs(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)


def test_quantize_rows_round_trip_and_zero_row():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 577, generator=gen) * 10.0 ** torch.randint(-20, 20, (64, 1), generator=gen)
    x[2] = 0
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.all((q.float() * s - x).abs() <= s / 2 + 1e-7)  # round-to-nearest: half a step
    assert s[2].item() == 1.0 and torch.all(q[2] == 0)
    u, su = quantize_rows(x, zero_point=128)  # the packed GEMM's uint8 input: the same steps, moved by 128
    assert u.dtype == torch.uint8 and torch.equal(su, s) and torch.equal(u.long(), q.long() + 128)
    with pytest.raises(ValueError, match="zero_point"):
        quantize_rows(x, zero_point=1)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_reference_within_quantization_bound(m, n, k):
    w, x = _inputs(m, n, k, seed=m + n)
    q, s = quantize_int8(w)
    y = w8a8_matmul_reference(x, q, s)
    # |x w - x~ w~| <= sum_k (|dx| |w~| + |x| |dw|) with |dx| <= s_x / 2, |dw| <= s_w / 2 elementwise.
    _, sx = quantize_rows(x)
    bound = (sx / 2) * (q.float() * s).abs().sum(1) + x.abs() @ (s.expand(n, k) / 2).T
    assert torch.all((y - x @ w.T).abs() <= bound * (1 + 1e-5) + 1e-5)


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int_mm_matches_reference(m, n, k, dtype):
    w, x = _inputs(m, n, k, seed=3 * m + k)
    q, s = quantize_int8(w)
    x = x.to(dtype)
    y = w8a8_matmul(x.unsqueeze(0), q, s)[0]
    ref = w8a8_matmul_reference(x, q, s)
    assert y.dtype == dtype and y.shape == (m, n)
    eps = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.float(), ref.float(), rtol=eps, atol=eps * ref.float().abs().max().item())


@pytest.fixture(scope="module")
def triton_w8a8():
    pytest.importorskip("triton")
    import kernels.w8a8_triton as mod

    return mod


@pytest.mark.parametrize("m,n,k", SHAPES[:4])
def test_triton_matches_reference(triton_w8a8, m, n, k):
    w, x = _inputs(m, n, k, seed=5 * m + n)
    q, s = quantize_int8(w)
    y = triton_w8a8.w8a8_matmul_triton(x, q, s)
    ref = w8a8_matmul_reference(x, q, s)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_triton_empty_batch(triton_w8a8):
    q, s = quantize_int8(torch.randn(8, 32))
    assert triton_w8a8.w8a8_matmul_triton(torch.empty(0, 32), q, s).shape == (0, 8)


class NoInt64Matmul(TorchDispatchMode):
    """CUDA has no int64 matmul: fail any matrix product over int64 operands, as a GPU would."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.matmul.default, torch.ops.aten.dot.default, torch.ops.aten.mv.default}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS and any(isinstance(a, torch.Tensor) and a.dtype == torch.int64 for a in args):
            raise RuntimeError(f"{func}: no int64 matmul on CUDA")
        return func(*args, **(kwargs or {}))


def test_reference_is_exact_without_an_int64_matmul():
    """The reference must run where a GPU runs it (no int64 matmul) and still sum exactly: the worst case
    (every product 127 x 127, K = 14336) against sums of elementwise int64 products."""
    gen = torch.Generator().manual_seed(11)
    n, k = 24, 14336
    x = torch.randn(5, k, generator=gen)
    x[0] = 1.0  # quantizes to 127 everywhere
    w = torch.randn(n, k, generator=gen)
    q, s = quantize_int8(w)
    q[0] = 127
    with NoInt64Matmul():
        y = w8a8_matmul_reference(x.double(), q, s)
    qx, sx = quantize_rows(x)
    exact = (qx.long()[:, None, :] * q.long()[None, :, :]).sum(-1)
    assert exact[0, 0] == 127 * 127 * k
    expected = exact.double() * sx.double() * s.double().reshape(1, -1)
    assert torch.equal(y, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_quantization_equals_quantize_rows(triton_w8a8, dtype):
    """The one-kernel quantization gives exactly quantize_rows' values and scales: ties round to even (rows
    scaled so that x / s lands on halves), a zero row gets scale 1, K not a multiple of the block."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 2500, generator=gen) * 10.0 ** torch.randint(-3, 3, (6, 1), generator=gen)
    x[1] = 0
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])  # scale exactly 1: ties
    x[2, 8:] = torch.randn(2492, generator=gen).clamp(-100, 100)
    x = x.to(dtype)
    q, s = triton_w8a8.quantize_rows_triton(x)
    ref_q, ref_s = quantize_rows(x)
    assert q.dtype == torch.int8 and torch.equal(q, ref_q) and torch.equal(s, ref_s)
    assert q[2, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
