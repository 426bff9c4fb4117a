"""The native W4A8 GEMM (`kernels.cpu_w4a8`) against its plain-torch arithmetic (`w4a8_reference`: exact
integer group sums), on shapes with partial panels and row tiles, in every build: where the kernel cannot
run (the AVX2 build, a CPU without AVX-512 VNNI, PIPELINE_NATIVE) it says why."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_w4a8
from kernels.cpu_w4a8 import (
    GROUP,
    activation_parts,
    pack_w4a8,
    pack_w4a8_reference,
    quantize_groups,
    unpack_w4a8,
    w4a8_matmul,
    w4a8_reference,
)
from kernels.wq_reference import dequantize, quantize_int4


def kernel_or_skip(build: str) -> None:
    """Skip where this build cannot run the kernel, after checking that it says so: the AVX2 build always,
    the native one only on a CPU without AVX-512 VNNI (or without a C compiler)."""
    why = cpu_w4a8.unavailable_reason()
    if build == "avx2":
        assert why is not None and "AVX-512 VNNI" in why
    if why is not None:
        with pytest.raises(RuntimeError, match="no native W4A8 GEMM"):
            w4a8_matmul(torch.randn(1, GROUP), torch.zeros(1, 1, 640, dtype=torch.uint8), 1)
        pytest.skip(why)


def int4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return quantize_int4(torch.randn(n, k) * 0.05, GROUP)


def tolerance(x: torch.Tensor, qweight, scales, mins) -> torch.Tensor:
    """float32 rounding of the kernel's sums: a few ulps of the sum of the terms' magnitudes."""
    return 1e-5 * (x.abs() @ dequantize(qweight, scales, mins, 4).abs().T) + 1e-6


@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (32, 64), (50, 160), (96, 2048), (33, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
def test_kernel_matches_the_reference(build, n, k, rows):
    """Panels of 32 channels and tiles of 4 rows, whole and partial, at one to many groups of k."""
    kernel_or_skip(build)
    qweight, scales, mins = int4_weight(n, k, seed=n * 1000 + k + rows)
    x = torch.randn(rows, k) * 3
    y = w4a8_matmul(x, pack_w4a8(qweight, scales, mins), n)
    reference = w4a8_reference(x, qweight, scales, mins)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert ((y - reference).abs() <= tolerance(x, qweight, scales, mins)).all()


def test_zero_groups_outliers_and_leading_dimensions(build):
    """A group of zeros (scale 1 there), one huge activation (its group's step alone is coarse), bf16 in
    and out, and [batch, seq, k] inputs."""
    kernel_or_skip(build)
    qweight, scales, mins = int4_weight(40, 128, seed=3)
    x = torch.randn(2, 3, 128)
    x[0, 0, :GROUP] = 0
    x[1, 2, 70] = 500.0
    packed = pack_w4a8(qweight, scales, mins)
    y = w4a8_matmul(x, packed, 40)
    reference = w4a8_reference(x.reshape(6, 128), qweight, scales, mins).reshape(2, 3, 40)
    assert y.shape == (2, 3, 40)
    assert ((y - reference).abs() <= tolerance(x.reshape(6, 128), qweight, scales, mins).reshape(2, 3, 40)).all()
    half = w4a8_matmul(x.bfloat16(), packed, 40)
    assert half.dtype == torch.bfloat16
    assert torch.allclose(half.float(), w4a8_matmul(x.bfloat16().float(), packed, 40), rtol=1e-2, atol=1e-2)


def test_the_reference_is_the_dequantized_product_up_to_the_second_parts_rounding():
    """The arithmetic itself (no kernel): within half a step of the second part (about 1/127 of the first's) of
    the float product with the dequantized weight, and equal to it where one part holds the activations."""
    qweight, scales, mins = int4_weight(24, 96, seed=5)
    weight = dequantize(qweight, scales.half().float(), mins.half().float(), 4)
    x = torch.randn(4, 96)
    x[1, 5] = 300.0  # an outlier: its group's first step is coarse, the second is not
    (q, first), (_, second) = activation_parts(x)
    assert (second <= first / 127 * 1.01).all()
    slopes = (weight - mins.float().repeat_interleave(GROUP, 1)).abs()  # |q s|: what a step of x moves
    bound = (second.repeat_interleave(GROUP, dim=1) / 2) @ slopes.T * 1.001 + 1e-4
    assert ((w4a8_reference(x, qweight, scales, mins) - x.double() @ weight.double().T).abs() <= bound).all()
    exact = q.float() * first.repeat_interleave(GROUP, dim=1)  # one part holds these (up to float32 rounding)
    assert torch.allclose(w4a8_reference(exact, qweight, scales, mins), exact @ weight.T, rtol=1e-5, atol=1e-5)


def test_quantize_groups_rounds_each_group_to_its_own_scale():
    x = torch.tensor([[*([1.0] * 31), 127.0, *([0.0] * 32)]])
    q, a = quantize_groups(x)
    assert a.tolist() == [[1.0, 1.0]]  # max 127 -> step 1; an all-zero group -> 1
    assert q[0, :32].tolist() == [1] * 31 + [127] and q[0, 32:].abs().sum() == 0


@pytest.mark.parametrize("n,k", [(32, 64), (48, 96), (80, 256)])
def test_unpacking_gives_back_the_packed_int4_weight(build, n, k):
    """`unpack_w4a8` inverts `pack_w4a8` bit for bit, the padding of a last partial panel left out: natively
    where the kernel is built, else in torch (the AVX2 build)."""
    qweight, scales, mins = quantize_int4(torch.randn(n, k) * 3, GROUP)
    got = unpack_w4a8(pack_w4a8(qweight, scales, mins), n)
    for value, expected in zip(got, (qweight, scales, mins), strict=True):
        assert value.dtype == expected.dtype and torch.equal(value, expected)


@pytest.mark.parametrize("n,k", [(32, 64), (48, 96), (80, 256)])
def test_native_packing_is_the_torch_reference(build, n, k):
    """The native packer lays the weight out as `pack_w4a8_reference` does, bit for bit, padding included."""
    kernel_or_skip(build)
    qweight, scales, mins = quantize_int4(torch.randn(n, k) * 3, GROUP)
    assert torch.equal(pack_w4a8(qweight, scales, mins), pack_w4a8_reference(qweight, scales, mins))


def test_packing_refuses_what_the_kernel_does_not_take():
    qweight, scales, mins = int4_weight(16, 128, seed=7)
    assert cpu_w4a8.weight_reason(qweight, scales, mins) is None
    with pytest.raises(ValueError, match="groups of 32 with mins"):
        pack_w4a8(qweight, scales, None)
    wide = quantize_int4(torch.randn(16, 128), 64)
    assert "groups of 32" in cpu_w4a8.weight_reason(*wide)
    assert "float16" in cpu_w4a8.weight_reason(qweight, scales.float() * 1e8, mins)
    for bad in (float("nan"), float("-inf")):
        odd = mins.clone()
        odd[3, 1] = bad
        assert "float16" in cpu_w4a8.weight_reason(qweight, scales, odd)
    with pytest.raises(ValueError, match="does not take"):
        w4a8_matmul(torch.randn(1, 64), pack_w4a8(qweight, scales, mins), 16)


def test_the_kernel_says_why_it_is_off(monkeypatch):
    monkeypatch.setenv("PIPELINE_NATIVE", "gemm,decode,attention")
    cpu_w4a8._library_or_reason.cache_clear()
    try:
        assert cpu_w4a8.unavailable_reason() == "PIPELINE_NATIVE=gemm,decode,attention leaves out the native w4a8"
    finally:
        cpu_w4a8._library_or_reason.cache_clear()
