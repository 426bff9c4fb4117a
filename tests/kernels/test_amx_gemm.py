"""The native W8A8 GEMM's two tiles (`kernels/cpu_int8_gemm.c`): AMX's, where this CPU has amx_int8 and the
build targets it, and the AVX-512 VNNI one, built on every VNNI CPU with `-mno-amx-tile -mno-amx-int8`. Each
entry point of both builds against exact integer sums, and the two against each other bit for bit, at row
counts past whole 8- and 16-row tiles, inputs past whole groups of 4 and of 64, outputs past whole panels."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator

import pytest
import torch

from kernels import native_build, vnni_gemm

BUILDS = {"native": "", "vnni": "-mno-amx-tile -mno-amx-int8"}  # extra compiler flags of each build
ROWS, INPUTS, OUTPUTS = (1, 7, 16, 17, 33, 64, 200), (64, 100, 576, 2048), (16, 48, 100, 576)
SHAPES = list(itertools.product(ROWS, INPUTS, OUTPUTS))
LEAD = 8  # activations read from a wider buffer: rows lda = k + 2 * LEAD apart, from column LEAD


@pytest.fixture(scope="module")
def libraries() -> Iterator[dict[str, ctypes.CDLL]]:
    """Each build's library, loaded side by side; afterwards the kernel loads as before."""
    loaded = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, flags in BUILDS.items():
            patch.setenv(native_build.EXTRA_FLAGS, flags)
            vnni_gemm._library_or_reason.cache_clear()
            why = vnni_gemm.unavailable_reason()
            if why:
                pytest.skip(f"no native int8 GEMM here: {why}")
            loaded[name] = vnni_gemm.library()
    vnni_gemm._library_or_reason.cache_clear()
    yield loaded


def _cpu_has_amx() -> bool:
    return "amx_int8" in native_build.cpu_identity().split()


def test_amx_runs_only_where_the_cpu_has_it_and_never_in_the_vnni_build(libraries):
    assert libraries["vnni"].int8_gemm_amx() == 0
    assert libraries["native"].int8_gemm_amx() in ((0, 1) if _cpu_has_amx() else (0,))


def test_an_amx_cpu_runs_amx_tiles_in_the_native_build(libraries):
    """This CPU's build has the AMX tile and Linux grants its state (every kernel since 5.16 does)."""
    if not _cpu_has_amx():
        pytest.skip("this CPU has no amx_int8")
    assert libraries["native"].int8_gemm_amx() == 1


def _problem(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations u uint8 [m, k] (a view into a wider buffer), weights int8 [n, k], column scales [n]."""
    gen = torch.Generator().manual_seed(m * 10007 + k * 101 + n)
    wide = torch.randint(0, 256, (m, k + 2 * LEAD), dtype=torch.uint8, generator=gen)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return wide[:, LEAD : LEAD + k], weight, torch.rand(n, generator=gen) / 100 + 1e-4


def _packed(library: ctypes.CDLL, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight in the kernel's panels, and its zero-point correction."""
    n, k = weight.shape
    panels = torch.empty(-(-n // vnni_gemm.PANEL) * -(-k // vnni_gemm.GROUP) * vnni_gemm.PANEL * vnni_gemm.GROUP,
                         dtype=torch.int8)
    correction = torch.empty(n, dtype=torch.int32)
    library.int8_gemm_pack(weight.data_ptr(), n, k, panels.data_ptr(), correction.data_ptr())
    return panels, correction


def _exact(u: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: exact integer sums of (u - 128) x weight, as float32, times the column scales."""
    return ((u.long() - 128) @ weight.long().T).float() * scale


def _products(library: ctypes.CDLL, u: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    panels, correction = _packed(library, weight)
    out = torch.full((u.shape[0], weight.shape[0]), float("nan"))
    assert library.int8_gemm(u.data_ptr(), u.stride(0), u.shape[0], u.shape[1], panels.data_ptr(),
                             correction.data_ptr(), scale.data_ptr(), weight.shape[0], out.data_ptr()) == 0
    return out


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_both_tiles_store_the_exact_products(libraries, m, k, n):
    u, weight, scale = _problem(m, k, n)
    expected = _exact(u, weight, scale)
    for library in libraries.values():
        assert torch.equal(_products(library, u, weight, scale), expected)


HOOK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)


@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (33, 576, 100), (200, 100, 576), (64, 2048, 48)])
def test_the_hooked_gemm_hands_each_tile_of_stored_products_to_its_hook_once(libraries, m, k, n):
    """int8_gemm_hooked: the hook sees each tile as stored (the exact products there) and what it adds to it
    stays; the tiles cover the products once each, on either build, threads calling it at once; it is told
    whether the GEMM runs on AMX (its tiles then configured for the hook)."""
    u, weight, scale = _problem(m, k, n)
    expected, added = _exact(u, weight, scale), torch.arange(m * n, dtype=torch.float32).view(m, n)
    for library in libraries.values():
        panels, correction = _packed(library, weight)
        out, seen, covered = torch.full((m, n), float("nan")), [], torch.zeros(m, n, dtype=torch.int64)

        def hook(_, r0, rows, c0, cols, address, ld, amx, seen=seen, covered=covered, library=library):
            values = (ctypes.c_float * ((rows - 1) * ld + cols)).from_address(address)
            tile = torch.frombuffer(values, dtype=torch.float32).as_strided((rows, cols), (ld, 1))
            seen.append(torch.equal(tile, expected[r0 : r0 + rows, c0 : c0 + cols]) and amx == library.int8_gemm_amx())
            covered[r0 : r0 + rows, c0 : c0 + cols] += 1
            tile += added[r0 : r0 + rows, c0 : c0 + cols]

        callback = HOOK(hook)
        assert library.int8_gemm_hooked(u.data_ptr(), u.stride(0), m, k, panels.data_ptr(), correction.data_ptr(),
                                        scale.data_ptr(), n, out.data_ptr(), callback, None) == 0
        assert seen and all(seen) and torch.equal(covered, torch.ones_like(covered))
        assert torch.equal(out, expected + added)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_both_tiles_give_the_argmax_of_the_scaled_products(libraries, m, k, n):
    """Over all columns and all but the last 7 (a partial panel): the first column of each row's largest
    product times its row scale."""
    u, weight, scale = _problem(m, k, n)
    weight[n - 1] = weight[0]  # a tie at the ends of the columns (the first one wins) where scales agree
    scale[n - 1] = scale[0]
    row_scale = torch.rand(m, generator=torch.Generator().manual_seed(n)) + 0.5
    scaled = _exact(u, weight, scale) * row_scale[:, None]
    for library, valid in itertools.product(libraries.values(), {n, max(1, n - 7)}):
        panels, correction = _packed(library, weight)
        index = torch.full((m,), -1, dtype=torch.int64)
        assert library.int8_gemm_argmax(u.data_ptr(), u.stride(0), m, k, panels.data_ptr(), correction.data_ptr(),
                                        scale.data_ptr(), valid, row_scale.data_ptr(), index.data_ptr()) == 0
        assert torch.equal(index, scaled[:, :valid].argmax(-1))


def _silu(library: ctypes.CDLL, u: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
          smooth: torch.Tensor) -> tuple[int, torch.Tensor]:
    """int8_gemm_silu's return code and output on the [gate; up] weight."""
    panels, correction = _packed(library, weight)
    half = weight.shape[0] // 2
    out = torch.full((u.shape[0], half), float("nan"))
    code = library.int8_gemm_silu(u.data_ptr(), u.stride(0), u.shape[0], u.shape[1], panels.data_ptr(),
                                  correction.data_ptr(), scale.data_ptr(), half, row_scale.data_ptr(),
                                  smooth.data_ptr(), out.data_ptr())
    return code, out


@pytest.mark.parametrize("m,k,half", SHAPES)
def test_both_tiles_give_the_same_gated_activation_and_torch_within_the_exp(libraries, m, k, half):
    """silu(gate x row scale) x up x row scale x smooth: the two builds bit for bit (the same epilogue on the
    same int32 sums), torch's within the exp's few ulp; a width not a multiple of the panel refused (-2)."""
    u, weight, scale = _problem(m, k, 2 * half)
    gen = torch.Generator().manual_seed(half)
    row_scale, smooth = torch.rand(m, generator=gen) * 4 + 0.1, torch.rand(half, generator=gen) + 0.5
    products = _exact(u, weight, scale) * row_scale[:, None]
    expected = torch.nn.functional.silu(products[:, :half]) * products[:, half:] * smooth
    results = [_silu(library, u, weight, scale, row_scale, smooth) for library in libraries.values()]
    if half % vnni_gemm.PANEL:
        assert all(code == -2 and out.isnan().all() for code, out in results)
        return
    assert all(code == 0 for code, _ in results)
    assert torch.equal(results[0][1], results[1][1])
    torch.testing.assert_close(results[0][1], expected, rtol=1e-5, atol=1e-6 * expected.abs().amax().item())
