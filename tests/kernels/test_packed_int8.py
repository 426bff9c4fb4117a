"""The packed int8 GEMMs (oneDNN's, `kernels.packed_int8`, and the native VNNI one, `kernels.vnni_gemm`)
against exact integer sums and `torch._int_mm`'s, bit for bit."""

from __future__ import annotations

import gc

import pytest
import torch

from kernels import packed_int8, vnni_gemm
from kernels.dispatch import int8_products, w8a8_matmul
from kernels.packed_int8 import (
    pack_int8_weight,
    pack_native_int8_weight,
    packed_bytes,
    packed_gemm_name,
    packed_int8_products,
    release_packed,
)
from pipeline.model.llama import cpp_compiler

# rows, inputs, outputs: rows past whole 8-row tiles, inputs past whole groups of 4, outputs past whole
# 48-channel panels (the native kernel's edges), and SmolLM2's shapes
SHAPES = [(0, 40, 96), (1, 40, 96), (3, 70, 160), (17, 33, 192), (9, 37, 49), (64, 96, 576), (130, 576, 960),
          (64, 1536, 576)]


def _native(owner: object, qweight: torch.Tensor) -> torch.Tensor:
    why = vnni_gemm.unavailable_reason()
    if why:
        pytest.skip(f"no native int8 GEMM here: {why}")
    return pack_native_int8_weight(owner, qweight)


PACKERS = [pytest.param(pack_int8_weight, id="onednn"), pytest.param(_native, id="native")]


class Owner:
    """Stands in for the module a packed weight belongs to."""


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 weights over the whole range this CPU's packed GEMM multiplies exactly."""
    gen = torch.Generator().manual_seed(seed)
    bound = packed_int8.weight_bound()
    q = torch.randint(-bound, bound + 1, (n, k), dtype=torch.int8, generator=gen)
    return q, torch.rand(n, 1, generator=gen) / 100 + 1e-4


@pytest.mark.parametrize("pack", PACKERS)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_packed_products_are_the_int32_sums_times_the_column_scales_bit_for_bit(m, k, n, pack):
    qweight, scales = _weight(n, k, seed=m + n)
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=torch.Generator().manual_seed(k))
    owner = Owner()
    handle = pack(owner, qweight)
    sums = (x.long() @ qweight.long().T).float()  # exact: |sums| < 2^24 for these sizes
    y = packed_int8_products(x, scales.reshape(-1), handle)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert torch.equal(y, sums * scales.reshape(1, -1))
    assert torch.equal(packed_int8_products(packed_int8.uint8_activations(x), scales.reshape(-1), handle), y)
    assert torch.equal(int8_products(x, qweight, scales, handle), int8_products(x, qweight, scales))
    assert packed_bytes(handle) == n * k


@pytest.mark.parametrize("pack", PACKERS)
def test_w8a8_matmul_on_the_packed_weight_equals_the_plain_one(pack):
    qweight, scales = _weight(160, 70, seed=1)
    x = torch.randn(2, 5, 70, generator=torch.Generator().manual_seed(2))
    owner = Owner()
    packed = w8a8_matmul(x, None, scales, pack(owner, qweight))
    assert packed.shape == (2, 5, 160)
    assert torch.equal(packed, w8a8_matmul(x, qweight, scales))


@pytest.mark.parametrize("pack", PACKERS)
def test_compiled_calls_take_the_weight_by_handle_in_one_graph(pack):
    """Two weights of one shape through one compiled function: the handle is an input, so the second
    weight reuses the graph, and each call multiplies by its own weight."""
    if cpp_compiler() is None:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    owner = Owner()
    weights = [_weight(96, 64, seed=s) for s in (3, 4)]
    handles = [pack(owner, q) for q, _ in weights]
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))

    def linear(x: torch.Tensor, scales: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        return w8a8_matmul(torch.relu(x), None, scales, handle) + 1.0

    torch._dynamo.reset()
    compiled = torch.compile(linear, dynamic=True)
    from torch._dynamo.utils import counters

    counters.clear()
    for (qweight, scales), handle in zip(weights, handles):
        expected = w8a8_matmul(torch.relu(x), qweight, scales) + 1.0
        torch.testing.assert_close(compiled(x, scales, handle), expected, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("pack", PACKERS)
def test_a_packed_weight_goes_with_its_owner_or_when_released(pack):
    owner, other = Owner(), Owner()
    qweight, _ = _weight(8, 16, seed=6)
    kept = pack(owner, qweight)
    released = pack(other, qweight)
    release_packed(released)
    assert int(released) not in packed_int8._packed and int(kept) in packed_int8._packed
    del owner
    gc.collect()
    assert int(kept) not in packed_int8._packed
    del other  # its finalizer finds the entry already gone
    gc.collect()


@pytest.mark.parametrize("pack", PACKERS)
def test_packing_names_what_it_cannot_take(pack):
    with pytest.raises(RuntimeError, match=r"int8 \[N, K\] weight, got torch.float32"):
        pack(Owner(), torch.randn(4, 8))


def test_each_handle_names_its_gemm():
    qweight, _ = _weight(8, 16, seed=7)
    owner = Owner()
    assert packed_gemm_name(pack_int8_weight(owner, qweight)) == "oneDNN packed"
    assert packed_gemm_name(_native(owner, qweight)) == "native VNNI"


def test_the_native_gemm_is_exact_at_the_extremes_and_on_strided_rows():
    """The largest sums its int32 lanes hold for SmolLM2-sized inputs (activations at both ends of uint8,
    weights at +-127), and rows read from a wider buffer in place."""
    k = 1536
    x = torch.full((11, k), 127, dtype=torch.int8)
    x[1::2] = -128  # uint8 0: the zero point's whole correction
    qweight = torch.full((50, k), 127, dtype=torch.int8)
    qweight[1::3] = -127
    owner = Owner()
    handle = _native(owner, qweight)
    expected = (x.long() @ qweight.long().T).float()
    assert torch.equal(packed_int8_products(x, torch.ones(50), handle), expected)
    wide = torch.zeros(11, k + 40, dtype=torch.uint8)
    wide[:, 8 : 8 + k] = packed_int8.uint8_activations(x)
    assert torch.equal(packed_int8_products(wide[:, 8 : 8 + k], torch.ones(50), handle), expected)


@pytest.mark.parametrize("n,k", [(96, 64), (50, 1538), (1, 3), (97, 4099)])
def test_the_native_panels_are_the_weight_by_panel_group_and_channel(n, k):
    """The packed layout against its definition in torch: panel p, group g of 4 k, channel c of the panel
    holds w[48 p + c, 4 g .. 4 g + 3], zeros past the weight; the correction is 128 x each channel's sum."""
    if vnni_gemm.unavailable_reason():
        pytest.skip(f"no native int8 GEMM here: {vnni_gemm.unavailable_reason()}")
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n + k))
    weight = vnni_gemm.NativeInt8Weight(qweight)
    panel, group = vnni_gemm.PANEL, vnni_gemm.GROUP
    padded = torch.zeros(-(-n // panel) * panel, -(-k // group) * group, dtype=torch.int8)
    padded[:n, :k] = qweight
    expected = padded.view(-1, panel, padded.shape[1] // group, group).transpose(1, 2).reshape(-1)
    assert torch.equal(weight.panels, expected)
    assert torch.equal(weight.correction, 128 * qweight.sum(1, dtype=torch.int32))


@pytest.mark.parametrize("n", [49152, 49150])
def test_the_native_gemm_streams_an_output_past_the_caches_to_the_same_bits(n):
    """Outputs over 8 MB (an LM head's) are written with streaming stores where rows stay 64-byte aligned
    (n a multiple of 16); otherwise with plain ones. Either way, the exact products."""
    qweight, scales = _weight(n, 64, seed=9)
    x = torch.randint(-127, 128, (48, 64), dtype=torch.int8, generator=torch.Generator().manual_seed(10))
    owner = Owner()
    y = packed_int8_products(x, scales.reshape(-1), _native(owner, qweight))
    assert y.numel() * 4 > 8 << 20
    assert torch.equal(y, (x.long() @ qweight.long().T).float() * scales.reshape(1, -1))


@pytest.mark.parametrize("m,k,n", SHAPES[1:] + [(64, 600, 49152)])
def test_the_native_argmax_is_the_argmax_of_the_scaled_products(m, k, n):
    """`NativeInt8Weight.argmax` keeps each row's best column in the GEMM's pass: the argmax of the products
    times the row scales over the first `valid` columns, equal values (planted: repeated weight rows, one
    across a panel's edge) going to the first column."""
    qweight, scales = _weight(n, k, seed=m * k)
    scales[n // 2 :] = scales[0]  # the upper half's columns: one scale, so that equal weight rows tie
    scales[: n // 2].clamp_(max=scales[0].item())  # and none larger below, so that row 0's best is planted
    qweight[n - 1] = qweight[n // 2]  # the same values in a middle and the last column
    qweight[min(n // 2 + 50, n - 2)] = qweight[n // 2 + 47 % (n - n // 2)]  # and across a panel's edge
    gen = torch.Generator().manual_seed(n)
    u = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=gen)
    u[0] = packed_int8.uint8_activations(qweight[n // 2])  # row 0's best: the middle column (tied with the last)
    row_scales = torch.rand(m, 1, generator=gen) + 0.5
    owner = Owner()
    native = packed_int8._packed[int(_native(owner, qweight))][0]
    products = native.products(u, scales.reshape(-1)) * row_scales
    for valid in (n, max(1, n - 7)):
        expected = products[:, :valid].argmax(-1)
        assert torch.equal(native.argmax(u, scales, row_scales, valid), expected)
    if n > 1:
        assert native.argmax(u, scales, row_scales, n)[0] == n // 2


@pytest.mark.parametrize("m,k,half", [(0, 40, 48), (1, 40, 48), (17, 37, 96), (130, 576, 1536)])
@pytest.mark.parametrize("smooth", [False, True])
def test_the_native_silu_entry_is_silu_of_the_scaled_gate_times_the_scaled_up(m, k, half, smooth):
    """`int8_gemm_silu` on a [gate; up] weight: silu(gate x row scale) x up x row scale (x the smoothing
    vector) from the products `int8_gemm` stores, within the exp's few ulp; a width that is not a multiple of
    the panel is refused (-2) without writing."""
    qweight, scales = _weight(2 * half, k, seed=m + k)
    gen = torch.Generator().manual_seed(half)
    u = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=gen)
    row_scales = torch.rand(m, generator=gen) * 4 + 0.1
    vector = torch.rand(half, generator=gen) + 0.5 if smooth else None
    owner = Owner()
    native = packed_int8._packed[int(_native(owner, qweight))][0]
    products = native.products(u, scales.reshape(-1)) * row_scales[:, None]
    expected = torch.nn.functional.silu(products[:, :half]) * products[:, half:]
    if smooth:
        expected = expected * vector
    out = torch.full((m, half), float("nan"))
    library = vnni_gemm.library()

    def call(width: int) -> int:
        return library.int8_gemm_silu(u.data_ptr(), k, m, k, native.panels.data_ptr(), native.correction.data_ptr(),
                                      scales.data_ptr(), width, row_scales.data_ptr(),
                                      vector.data_ptr() if smooth else None, out.data_ptr())

    assert call(half) == 0
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6 * (expected.abs().amax().item() if m else 1.0))
    if m:
        out.fill_(float("nan"))
        assert call(half - 1) == -2 and out.isnan().all()


def test_the_native_gemm_names_what_it_cannot_multiply():
    qweight, scales = _weight(20, 16, seed=8)
    owner = Owner()
    native = packed_int8._packed[int(_native(owner, qweight))][0]
    with pytest.raises(ValueError, match=r"uint8 activations \[M, 16\], got torch.int8"):
        native.products(torch.zeros(3, 16, dtype=torch.int8), scales.reshape(-1))
    with pytest.raises(ValueError, match="20 column scales, got 19"):
        native.products(torch.zeros(3, 16, dtype=torch.uint8), scales.reshape(-1)[:19])
    u = torch.zeros(3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="valid=21 columns of 20"):
        native.argmax(u, scales, torch.ones(3), 21)
    with pytest.raises(ValueError, match="expected 3 row scales, got 2"):
        native.argmax(u, scales, torch.ones(2), 20)


def test_the_native_gemm_says_why_it_is_off(monkeypatch):
    monkeypatch.setenv("PIPELINE_NATIVE", "decode,attention")
    vnni_gemm._library_or_reason.cache_clear()
    try:
        assert vnni_gemm.unavailable_reason() == "PIPELINE_NATIVE=decode,attention leaves out the native gemm"
        with pytest.raises(RuntimeError, match="no native int8 GEMM: PIPELINE_NATIVE=decode,attention leaves out the native gemm"):
            pack_native_int8_weight(Owner(), torch.zeros(4, 8, dtype=torch.int8))
    finally:
        vnni_gemm._library_or_reason.cache_clear()


def test_the_weight_bound_is_exact_in_the_worst_case_and_full_range_weights_beyond_it_would_not_be():
    """At the measured bound, the largest products (activations 127, weights +-bound) come out exact; a bound
    below 127 means the full range did not (the kernel sums u8 x s8 pairs in int16)."""
    bound = packed_int8.weight_bound()
    assert bound in (packed_int8.FULL_RANGE, packed_int8.PAIR_SAFE_RANGE)
    x = torch.full((5, 256), 127, dtype=torch.int8)
    x[1] = -127
    signs = torch.where(torch.arange(256) % 3 == 0, -1, 1).to(torch.int8)
    qweight = torch.stack([torch.full((256,), bound, dtype=torch.int8), signs * bound])
    owner = Owner()
    y = packed_int8_products(x, torch.ones(2), pack_int8_weight(owner, qweight))
    assert torch.equal(y, (x.long() @ qweight.long().T).float())
    if bound < packed_int8.FULL_RANGE:
        full = torch.full((2, 256), 127, dtype=torch.int8)
        packed = torch.ops.onednn.qlinear_prepack(full, None)
        sums = packed_int8._run_packed(packed_int8.uint8_activations(x), torch.ones(2), packed, torch.zeros(2, dtype=torch.long))
        assert not torch.equal(sums, (x.long() @ full.long().T).float())


def test_packing_refuses_a_weight_beyond_the_bound(monkeypatch):
    monkeypatch.setattr(packed_int8, "weight_bound", lambda: packed_int8.PAIR_SAFE_RANGE)
    within = torch.full((4, 16), -63, dtype=torch.int8)
    owner = Owner()
    assert int(pack_int8_weight(owner, within)) in packed_int8._packed
    beyond = within.clone()
    beyond[2, 5] = -64
    with pytest.raises(RuntimeError, match=r"exact for \|weight\| <= 63 only"):
        pack_int8_weight(Owner(), beyond)
