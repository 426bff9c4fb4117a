"""The native load-time quantizers give `kernels.wq_reference`'s bytes exactly: random weights in float32 and
bfloat16, groups that are constant or all zero, values that land exactly half-way between two steps (round
half to even), per-channel and grouped int8 with a reduced bound, in the native and the AVX2 build; and the
reference runs (with its errors) wherever the native pass cannot."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_quantize, native_build, wq_reference


def crafted(rows: int, k: int, group: int) -> torch.Tensor:
    """Random weights, with groups that are all zero, constant, and exactly on rounding ties."""
    torch.manual_seed(rows * k + group)
    w = torch.randn(rows, k) * 0.05
    w[0, :group] = 0.0
    w[1, :group] = 0.25
    # min 0, max 15 -> int4 scale 1: (w - 0) / 1 = x.5, a tie, everywhere between them
    w[2, :group] = torch.cat([torch.tensor([0.0, 15.0]), torch.arange(group - 2).remainder(15) + 0.5])
    # max|w| = 127 -> int8 scale 1 per channel: ties at +-x.5 everywhere else
    w[3] = (torch.arange(k).remainder(254) - 127 + 0.5).clamp(-126.5, 126.5)
    w[3, 0] = 127.0
    # row 2 a step up (min 1): its ties on the AVX-512 int4 path, which leaves groups with a zero or a NaN at
    # the min or max to the scalar one
    w[4, :group] = w[2, :group] + 1.0
    return w


SHAPES = [(16, 256, 32), (33, 512, 64), (8, 2048, 128), (5, 96, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,k,group", SHAPES)
def test_int4_bytes_equal_the_reference(build: str, dtype: torch.dtype, rows: int, k: int, group: int) -> None:
    assert cpu_quantize.unavailable_reason() is None
    w = crafted(rows, k, group).to(dtype)
    for native, reference in zip(cpu_quantize.quantize_int4(w, group), wq_reference.quantize_int4(w, group)):
        assert native.dtype == reference.dtype and torch.equal(native, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,bound", [(None, 127), (32, 127), (None, 119)])
def test_int8_bytes_equal_the_reference(build: str, dtype: torch.dtype, group: int | None, bound: int) -> None:
    w = crafted(24, 320, 32).to(dtype)
    native = cpu_quantize.quantize_int8(w, group, bound)
    reference = wq_reference.quantize_int8(w, group, bound)
    for a, b in zip(native, reference):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_ties_round_half_to_even() -> None:
    """The crafted tie rows do hit ties, and both sides round them to even (not away from zero)."""
    w = torch.tensor([[0.0, 0.5, 1.5, 2.5, 15.0, 13.5, 14.5, 3.5]])
    q, scales, mins = cpu_quantize.quantize_int4(w, 8)
    assert scales.item() == 1.0 and mins.item() == 0.0
    assert wq_reference.unpack_int4(q).tolist() == [[0, 0, 2, 2, 15, 14, 14, 4]]
    q8, s8 = cpu_quantize.quantize_int8(torch.tensor([[127.0, 0.5, -1.5, 2.5, -3.5]]))
    assert s8.item() == 1.0 and q8.tolist() == [[127, 0, -2, 2, -4]]


def test_the_reference_runs_where_the_native_pass_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    w = crafted(8, 128, 32)
    # float16 input and a non-contiguous view: the reference's results, unchanged
    for x in (w.half(), w.t().contiguous().t()):
        for a, b in zip(cpu_quantize.quantize_int4(x, 32), wq_reference.quantize_int4(x, 32)):
            assert torch.equal(a, b)
    # the reference's shape errors, word for word
    with pytest.raises(ValueError, match="not a multiple of the"):
        cpu_quantize.quantize_int4(w, 48)
    with pytest.raises(ValueError, match="int8 bound must be in 1..127"):
        cpu_quantize.quantize_int8(w, None, 200)
    monkeypatch.setenv(native_build.SWITCH, "off")
    cpu_quantize._library_or_reason.cache_clear()
    try:
        assert "leaves out the native quantize" in cpu_quantize.unavailable_reason()
        for a, b in zip(cpu_quantize.quantize_int4(w, 32), wq_reference.quantize_int4(w, 32)):
            assert torch.equal(a, b)
    finally:
        monkeypatch.undo()
        cpu_quantize._library_or_reason.cache_clear()


@pytest.mark.parametrize("bits,group,with_mins", [(4, 32, True), (4, 64, False), (8, 32, False), (8, None, False),
                                                  (8, 32, True)])
def test_dequantize_equals_the_reference(build: str, bits: int, group: int | None, with_mins: bool) -> None:
    w = crafted(12, 256, 32)
    if bits == 4:
        q, scales, mins = cpu_quantize.quantize_int4(w, group)
    else:
        (q, scales), mins = cpu_quantize.quantize_int8(w, group), None
    if with_mins and mins is None:  # an int8 format with offsets: the reference adds them too
        mins = torch.randn(scales.shape).to(scales.dtype)
    mins = mins if with_mins else None
    native = cpu_quantize.dequantize(q, scales, mins, bits)
    reference = wq_reference.dequantize(q, scales, mins, bits)
    assert native.dtype == torch.float32 and torch.equal(native, reference)
    out = torch.full_like(reference, float("nan"))  # a buffer from an earlier weight
    assert cpu_quantize.dequantize(q, scales, mins, bits, out) is out and torch.equal(out, reference)


def test_dequantize_refuses_an_out_of_another_shape() -> None:
    q, scales, mins = cpu_quantize.quantize_int4(crafted(12, 256, 32), 32)
    for out in (torch.empty(12, 128), torch.empty(12, 256, dtype=torch.bfloat16), torch.empty(256, 12).T):
        with pytest.raises(ValueError, match="contiguous float32 12 x 256"):
            cpu_quantize.dequantize(q, scales, mins, 4, out)
