"""The shared storage format: packing, quantization round trips and dequantization, exact expectations."""

from __future__ import annotations

import pytest
import torch

from kernels import wq_reference
from kernels.wq_reference import (
    dequantize,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    wq_matmul_reference,
)


def test_pack_int4_layout_and_round_trip():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 3, 12]])
    packed = pack_int4(q)
    # even k in the low nibble, odd k in the high nibble
    assert packed.tolist() == [[1 | 2 << 4, 15 | 0 << 4], [7 | 8 << 4, 3 | 12 << 4]]
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    every = torch.arange(256).reshape(2, 128) % 16
    assert torch.equal(unpack_int4(pack_int4(every)), every.to(torch.uint8))


def test_pack_int4_rejects_odd_columns():
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


def test_int4_group_exact_on_grid_values():
    # A group holding every step of a 4-bit grid (min -1, step 0.25, exact in fp16) quantizes losslessly.
    grid = -1.0 + 0.25 * torch.arange(16.0)
    w = torch.stack([torch.cat([grid, grid.flip(0)]), torch.cat([grid * 2, grid * 2])])
    q, s, m = quantize_int4(w, 32)
    assert s.dtype == torch.float16 and s.tolist() == [[0.25], [0.5]]
    assert m.tolist() == [[-1.0], [-2.0]]
    assert unpack_int4(q)[0, :16].tolist() == list(range(16))
    assert torch.equal(dequantize(q, s, m, 4), w)


def test_int4_round_to_nearest_error_bound():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(0))
    for g in (32, 64, 128):
        q, s, m = quantize_int4(w, g)
        err = (dequantize(q, s, m, 4) - w).abs().unflatten(1, (-1, g))
        # half a step plus the fp16 rounding of min/scale (relative 2^-11 of values up to |w|max)
        bound = s.float().unsqueeze(-1) / 2 + w.abs().max() * 2**-10
        assert (err <= bound).all()


def test_int8_per_channel_exact_and_symmetric():
    w = torch.tensor([[127.0, -63.5, 0.5, 0.0], [-2.54, 1.27, 0.0, 0.01]])
    q, s = quantize_int8(w)
    assert s.shape == (2, 1) and s.dtype == torch.float32
    assert q[0].tolist() == [127, -64, 0, 0]  # -63.5 rounds half to even, 0.5 rounds to 0
    assert q[1].tolist() == [-127, 64, 0, 0]  # 1.27 / 0.02 = 63.5 -> 64 (float32 of 1.27 is above 1.27)
    assert torch.equal(dequantize(q, s, None, 8)[0], torch.tensor([127.0, -64.0, 0.0, 0.0]))


def test_int8_bound_holds_the_values_within_it_at_half_a_step():
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    q, s = quantize_int8(w, bound=63)
    assert int(q.abs().max()) == 63 and torch.equal(s, w.abs().amax(1, keepdim=True) / 63)
    assert ((dequantize(q, s, None, 8) - w).abs() <= s * 0.5 + w.abs().max() * 2**-20).all()
    with pytest.raises(ValueError, match="bound must be in 1..127"):
        quantize_int8(w, bound=128)


def test_int8_grouped_scales():
    w = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    q, s = quantize_int8(w, 32)
    assert s.shape == (4, 3) and s.dtype == torch.float16
    err = (dequantize(q, s, None, 8) - w).abs().unflatten(1, (3, 32))
    assert (err <= s.float().unsqueeze(-1) * 0.5 + w.abs().max() * 2**-9).all()


def test_reference_matmul_matches_dense():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(10, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    q, s, m = quantize_int4(w, 32)
    y = wq_matmul_reference(x, q, s, m, 4)
    assert torch.allclose(y, x @ dequantize(q, s, m, 4).T, atol=1e-5)
    assert wq_matmul_reference(x.bfloat16(), q, s, m, 4).dtype == torch.bfloat16


def test_bad_bits_and_groups():
    with pytest.raises(ValueError, match="bits"):
        dequantize(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(2, 1), None, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_int4(torch.zeros(2, 48), 32)
    with pytest.raises(ValueError, match="divide"):
        dequantize(torch.zeros(2, 48, dtype=torch.int8), torch.ones(2, 5), None, 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_slice_by_slice_equals_one_whole_pass(monkeypatch, bits):
    """The quantizers run a weight in row slices (cache-sized); slices of one row and of the whole weight
    must give the same bytes, zero rows and a row count the slice does not divide included."""
    w = torch.randn(37, 128, generator=torch.Generator().manual_seed(3))
    w[5] = 0.0

    def quantize():
        return quantize_int4(w, 32) if bits == 4 else quantize_int8(w, bound=63)

    monkeypatch.setattr(wq_reference, "SLICE_ELEMENTS", 128 * 37)
    whole = quantize()
    monkeypatch.setattr(wq_reference, "SLICE_ELEMENTS", 3 * 128)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(whole, quantize()))
