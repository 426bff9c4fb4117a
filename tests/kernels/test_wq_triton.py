"""Triton W4A16 / W8A16 GEMM under TRITON_INTERPRET=1 on CPU against the plain-torch reference.

Shapes are small (the interpreter costs ~1 ms per program): odd M, N not a multiple of BLOCK_N, K not
a multiple of BLOCK_K, groups 32/64/128 and per channel.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")
import kernels.wq_triton as wq_triton  # noqa: E402
from kernels.wq_reference import quantize_int4, quantize_int8, wq_matmul_reference  # noqa: E402

if type(wq_triton._wq_matmul_kernel).__name__ != "InterpretedFunction":  # imported earlier without it
    wq_triton = importlib.reload(wq_triton)

SHAPES = [(1, 40, 96, 32), (3, 70, 160, 32), (17, 33, 192, 64), (5, 24, 128, 128), (33, 16, 256, 128)]


def _inputs(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)


def _tolerance(y_ref: torch.Tensor, dtype: torch.dtype) -> float:
    eps = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    return 4 * eps * max(1.0, y_ref.float().abs().max().item())


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w4a16_matches_reference(m, n, k, g, dtype):
    w, x = _inputs(m, n, k, seed=m * 7 + g)
    q, s, mins = quantize_int4(w, g)
    x = x.to(dtype)
    y = wq_triton.wq_matmul_triton(x, q, s, mins, 4)
    ref = wq_matmul_reference(x, q, s, mins, 4)
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - ref.float()).abs().max().item() <= _tolerance(ref, dtype)


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_w8a16_matches_reference(m, n, k, g, per_channel):
    w, x = _inputs(m, n, k, seed=m * 11 + g)
    q, s = quantize_int8(w, None if per_channel else g)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        y = wq_triton.wq_matmul_triton(xd, q, s, None, 8)
        ref = wq_matmul_reference(xd, q, s, None, 8)
        assert (y.float() - ref.float()).abs().max().item() <= _tolerance(ref, dtype)


def test_batched_input_and_empty_batch():
    w, x = _inputs(4, 20, 64, seed=3)
    q, s, mins = quantize_int4(w, 32)
    x3 = x.reshape(2, 2, 64)
    y = wq_triton.wq_matmul_triton(x3, q, s, mins, 4)
    assert y.shape == (2, 2, 20)
    assert torch.allclose(y.reshape(4, 20), wq_matmul_reference(x, q, s, mins, 4), atol=1e-4)
    assert wq_triton.wq_matmul_triton(x[:0], q, s, mins, 4).shape == (0, 20)


def test_shape_mismatch_is_an_error():
    w, x = _inputs(2, 8, 64, seed=4)
    q, s, mins = quantize_int4(w, 32)
    with pytest.raises(ValueError, match="does not match input features 32"):
        wq_triton.wq_matmul_triton(x[:, :32], q, s, mins, 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_sums_to_the_reference(bits, split):
    """Split-K: each program a share of K's tiles (uneven shares included), float32 partials summed."""
    m, n, k, g = 3, 40, 512, 32
    w, x = _inputs(m, n, k, seed=split)
    if bits == 4:
        q, s, mins = quantize_int4(w, g)
    else:
        (q, s), mins = quantize_int8(w, g), None
    for dtype in (torch.float32, torch.bfloat16):
        y = wq_triton.wq_matmul_triton(x.to(dtype), q, s, mins, bits, split_k=split)
        ref = wq_matmul_reference(x.to(dtype), q, s, mins, bits)
        assert y.dtype == dtype
        assert (y.float() - ref.float()).abs().max().item() <= _tolerance(ref, dtype)


def test_tile_choices():
    assert wq_triton.block_k_for(4096, 32) == 32 and wq_triton.block_k_for(4096, 128) == 128
    assert wq_triton.block_k_for(4160, 4160) == 128  # one group per row: any tile
    with pytest.raises(ValueError, match="multiple of 32"):
        wq_triton.block_k_for(480, 48)
    # H200 (132 SMs), batch 1: a 4096x4096 weight has 64 output tiles -> 5 programs each; a full batch none.
    assert wq_triton.split_k_for(1, 4096, 4096, 128, 132) == 5
    assert wq_triton.split_k_for(256, 4096, 4096, 128, 132) == 1
    assert wq_triton.split_k_for(1, 4096, 256, 128, 132) == 1  # too few K tiles to share
