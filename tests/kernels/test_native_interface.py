"""The native kernels' one C interface (`kernels/cpu_kernels.h`): every kernel is built from it, the ctypes
mirrors of its structs have the compiler's layout, and the kernels that need AVX-512 say so in a build
without it."""

from __future__ import annotations

import ctypes
import itertools
import shlex
from itertools import count
from pathlib import Path

import pytest
import torch

from kernels import cpu_decode_layers, vnni_gemm
from kernels.cpu_decode_layers import Layer, Linear, Step
from kernels.native_build import build_flags, built_library, c_compiler, cpu_identity, source_text

HEADER = Path(cpu_decode_layers.__file__).with_name("cpu_kernels.h")
MIRRORS = {"linear": Linear, "layer": Layer, "step": Step}  # C struct name -> its ctypes mirror

Layout = dict[str | None, tuple[int, int]]  # field -> (offset, size); None -> (0, the struct's size)


@pytest.fixture(scope="module")
def c_layouts() -> dict[str, Layout]:
    """`struct_layout`'s table, from cpu_decode_layers.c built for this machine (it is there in every build)."""
    compiler = c_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    entry = ctypes.CDLL(str(built_library(compiler, cpu_decode_layers.SOURCE))).struct_layout
    entry.argtypes = [ctypes.c_int64, *[ctypes.POINTER(ctypes.c_char_p)] * 2, *[ctypes.POINTER(ctypes.c_int64)] * 2]
    structure, field, offset, size = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
    layouts: dict[str, Layout] = {}
    for i in count():
        if not entry(i, *map(ctypes.byref, (structure, field, offset, size))):
            return layouts
        name = field.value.decode() if field.value else None
        layouts.setdefault(structure.value.decode(), {})[name] = (offset.value, size.value)


def ctypes_layout(mirror: type[ctypes.Structure]) -> Layout:
    fields = {name: (getattr(mirror, name).offset, getattr(mirror, name).size) for name, _ in mirror._fields_}
    return {None: (0, ctypes.sizeof(mirror)), **fields}


@pytest.mark.parametrize("source", sorted(HEADER.parent.glob("*.c")), ids=lambda path: path.name)
def test_every_kernel_is_built_from_the_interface_header(source):
    """Each kernel includes the header, and its cache key holds the header's text: a change there rebuilds
    every library."""
    assert '#include "cpu_kernels.h"' in source.read_text()
    assert HEADER.read_text() in source_text(source)


def test_the_ctypes_mirrors_have_the_c_layout(c_layouts):
    """Every struct's size and every field's offset and size as the compiler lays them out; a field added,
    dropped, renamed, moved or resized on one side only fails here."""
    assert {name: ctypes_layout(mirror) for name, mirror in MIRRORS.items()} == c_layouts


@pytest.mark.parametrize("name", MIRRORS)
def test_the_layout_table_lists_every_field(c_layouts, name):
    """The listed fields tile the struct without gaps (the structs have no padding), so a field added to
    the struct but not to the table leaves one, or changes the struct's size."""
    spans = sorted(span for field, span in c_layouts[name].items() if field is not None)
    ends = [offset + size for offset, size in spans]
    assert [offset for offset, _ in spans] == [0, *ends[:-1]]
    assert ends[-1] == c_layouts[name][None][1]


def test_the_kernels_that_need_avx512_say_so_in_a_build_without_it(build):
    """The VNNI GEMM and the decoder layers have no AVX2 code: built with AVX-512 off, their stubs report
    them unavailable (callers keep oneDNN's GEMM and the compiled graphs), where the native build runs."""
    compiler = c_compiler()
    if compiler is None or "avx512_vnni" not in cpu_identity().split():
        pytest.skip("needs a C compiler and a CPU with AVX-512 VNNI")
    reasons = [vnni_gemm.unavailable_reason(), cpu_decode_layers.unavailable_reason()]
    if build == "native":
        assert reasons == [None, None]
        return
    flags = shlex.join(build_flags())
    assert "-mno-avx512f" in flags
    assert reasons == [f"{compiler} built {module.SOURCE.name} without AVX-512 VNNI (flags: {flags})"
                       for module in (vnni_gemm, cpu_decode_layers)]
    with pytest.raises(RuntimeError, match="no native int8 GEMM: .* without AVX-512 VNNI"):
        vnni_gemm.NativeInt8Weight(torch.zeros(4, 8, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="no native decode layers: .* without AVX-512 VNNI"):
        cpu_decode_layers.decode_layers((Layer * 1)(), Step(), 0)


def test_lora_tiles_hold_pairs_of_rows_side_by_side_for_each_16_columns():
    """`pack_tiles` against its definition: tile [s, block, p, j, e] is t[s, 2p + e, 16 block + j] in bfloat16,
    zero past the rows (K up to the multiple asked for) and columns (C up to a multiple of 16)."""
    t = torch.randn(3, 37, 21)
    for multiple, depth in ((32, 64), (16, 48)):
        tiles = cpu_decode_layers.pack_tiles(t, multiple)
        assert tiles.shape == (3, 2, depth // 2, 16, 2) and tiles.dtype == torch.bfloat16
        for s, block, p, j, e in itertools.product(range(3), range(2), range(depth // 2), range(16), range(2)):
            row, column = 2 * p + e, 16 * block + j
            value = t[s, row, column] if row < 37 and column < 21 else torch.tensor(0.0)
            assert tiles[s, block, p, j, e] == value.bfloat16(), (multiple, s, block, p, j, e)
