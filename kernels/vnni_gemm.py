"""The native W8A8 GEMM for CPUs with AVX-512 VNNI (`kernels/cpu_int8_gemm.c`), on a weight packed once
into its panels.

It takes what oneDNN's packed GEMM takes (uint8 activations with zero point 128, `kernels.packed_int8`) and
gives the same bits: float32 exact int32 sums x the column's scale. Why a kernel of our own: at the row
counts decode steps run (64-256), with a step's weights streaming from memory, oneDNN's int8 GEMMs
(`torch._int_mm` and the packed one) reached 55-87% of this class of CPU's int8 peak, and 64 rows were the
worst; one register tile of 8 rows x 48 channels looping over a packed panel does better there (figures in
docs/performance.md). On CPUs with AMX the same panels feed AMX tiles of 16 rows x 48 channels instead
(`uses_amx`), as fast as oneDNN's AMX GEMM; `PIPELINE_KERNEL_FLAGS=-mno-amx-int8` builds the VNNI tile. The model times it against oneDNN's at load and keeps the faster
(`pipeline.model.w8a8_gemm`). Its argmax entry (`NativeInt8Weight.argmax`) gives
each row's best column of the products without storing them, for the int8 LM head's greedy steps; its SiLU
entry (`int8_gemm_silu`, called from the native decode layers) gives a gate_up weight's gated activation
without storing the products.

Built by `kernels.native_build`; where it cannot run (no AVX-512 VNNI, no C compiler,
`PIPELINE_NATIVE` leaving out `gemm`), `unavailable_reason` says why.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import loaded_library

SOURCE = Path(__file__).with_name("cpu_int8_gemm.c")
PANEL = 48  # output channels per panel (NR in the C source)
GROUP = 4  # k per vpdpbusd lane


def unavailable_reason() -> str | None:
    """Why the native GEMM cannot run here, or None."""
    library = _library_or_reason()
    return library if isinstance(library, str) else None


def library() -> ctypes.CDLL:
    """The loaded kernel library (its `int8_gemm` and `int8_gemm_silu` are what callers in C take as function
    pointers); RuntimeError where it cannot run."""
    loaded = _library_or_reason()
    if isinstance(loaded, str):
        raise RuntimeError(f"no native int8 GEMM: {loaded}")
    return loaded


@cache
def _library_or_reason() -> ctypes.CDLL | str:
    """Built and loaded once per process; a failure is remembered too."""
    library = loaded_library(SOURCE, "gemm", "avx512_vnni", "AVX-512 VNNI", "int8_gemm_available")
    if isinstance(library, str):
        return library
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.int8_gemm.argtypes = [pointer, size, size, size, pointer, pointer, pointer, size, pointer]
    library.int8_gemm.restype = ctypes.c_int
    library.int8_gemm_hooked.argtypes = [pointer, size, size, size, pointer, pointer, pointer, size, pointer, pointer,
                                         pointer]
    library.int8_gemm_hooked.restype = ctypes.c_int
    library.int8_gemm_argmax.argtypes = [pointer, size, size, size, pointer, pointer, pointer, size, pointer, pointer]
    library.int8_gemm_argmax.restype = ctypes.c_int
    library.int8_gemm_silu.argtypes = [pointer, size, size, size, pointer, pointer, pointer, size, pointer, pointer,
                                       pointer]
    library.int8_gemm_silu.restype = ctypes.c_int
    library.int8_gemm_pack.argtypes = [pointer, size, size, pointer, pointer]
    library.int8_gemm_pack.restype = None
    library.int8_gemm_amx.argtypes = []
    library.int8_gemm_amx.restype = ctypes.c_int
    return library


def uses_amx() -> bool:
    """Whether the kernel's tiles run on AMX here (built with it, the CPU has amx_int8, Linux granted the
    tile state), else on AVX-512 VNNI: the same bits either way. RuntimeError where the kernel cannot run."""
    return bool(library().int8_gemm_amx())


class NativeInt8Weight:
    """An int8 weight [N, K] in the kernel's panels, with each channel's zero-point correction
    (128 x its weights' sum). Raises RuntimeError where the kernel cannot run (`unavailable_reason`)."""

    name = "native VNNI"

    def __init__(self, qweight: torch.Tensor):
        self._library = library()
        if qweight.device.type != "cpu" or qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise RuntimeError(f"the native int8 GEMM takes a CPU int8 [N, K] weight, got {qweight.dtype} "
                               f"{tuple(qweight.shape)} on {qweight.device}")
        self.out_features, self.in_features = qweight.shape
        qweight = qweight.contiguous()
        panels, groups = -(-self.out_features // PANEL), -(-self.in_features // GROUP)
        self.panels = torch.empty(panels * groups * PANEL * GROUP, dtype=torch.int8)
        self.correction = torch.empty(self.out_features, dtype=torch.int32)
        self._library.int8_gemm_pack(qweight.data_ptr(), self.out_features, self.in_features,
                                     self.panels.data_ptr(), self.correction.data_ptr())

    def products(self, u: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
        """u uint8 [M, K] (int8 activations + 128) times the weight: float32 [M, N], each exact int32 sum
        times its column's scale wscale [N]."""
        u, wscale = self._inputs(u, wscale)
        out = torch.empty(u.shape[0], self.out_features, dtype=torch.float32)
        if u.shape[0] and self._library.int8_gemm(u.data_ptr(), u.stride(0), u.shape[0], self.in_features,
                                                  self.panels.data_ptr(), self.correction.data_ptr(),
                                                  wscale.data_ptr(), self.out_features, out.data_ptr()):
            raise MemoryError(f"no memory for a padded copy of {u.shape[0]} x {self.in_features} activations")
        return out

    def argmax(self, u: torch.Tensor, wscale: torch.Tensor, row_scales: torch.Tensor, valid: int) -> torch.Tensor:
        """`(products(u, wscale) * row_scales)[:, :valid].argmax(-1)` (int64 [M]) without writing the
        products: the same float32 values, the first column of a tie. row_scales [M] (or [M, 1]) must be
        finite, as torch's choice on NaN values is not reproduced."""
        u, wscale = self._inputs(u, wscale)
        if not 0 < valid <= self.out_features:
            raise ValueError(f"valid={valid} columns of {self.out_features}")
        row_scales = row_scales.float().reshape(-1).contiguous()
        if row_scales.numel() != u.shape[0]:
            raise ValueError(f"expected {u.shape[0]} row scales, got {row_scales.numel()}")
        index = torch.empty(u.shape[0], dtype=torch.int64)
        if u.shape[0] and self._library.int8_gemm_argmax(u.data_ptr(), u.stride(0), u.shape[0], self.in_features,
                                                         self.panels.data_ptr(), self.correction.data_ptr(),
                                                         wscale.data_ptr(), valid, row_scales.data_ptr(),
                                                         index.data_ptr()):
            raise MemoryError(f"no memory for the argmax of {u.shape[0]} x {self.in_features} activations")
        return index

    def _inputs(self, u: torch.Tensor, wscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u and wscale checked against the weight's shape, as the kernel reads them."""
        if u.dtype != torch.uint8 or u.dim() != 2 or u.shape[1] != self.in_features:
            raise ValueError(f"expected uint8 activations [M, {self.in_features}], got {u.dtype} {tuple(u.shape)}")
        if wscale.numel() != self.out_features:
            raise ValueError(f"expected {self.out_features} column scales, got {wscale.numel()}")
        if u.stride(1) != 1:
            u = u.contiguous()
        return u, wscale.float().reshape(-1).contiguous()
