"""Load-time weight quantizers and their inverse: `kernels.wq_reference`'s `quantize_int4`, `quantize_int8` and
`dequantize`, bit for bit, in one native pass per group (`kernels/cpu_quantize.c`) where it can run, else the
reference itself.

Why: the reference's elementwise passes dominated a first start of a 1B-parameter model (rounding every
weight, then dequantizing each linear twice in the calibration pass); the native pass reads each weight once. Any CPU with a C compiler
runs it (plain C, no vector extension required); `PIPELINE_NATIVE` leaving out `quantize` keeps the reference.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels import wq_reference
from kernels.native_build import loaded_library

SOURCE = Path(__file__).with_name("cpu_quantize.c")


@cache
def _library_or_reason() -> ctypes.CDLL | str:
    """Built and loaded once per process; a failure is remembered too."""
    library = loaded_library(SOURCE, "quantize", "sse2", "SSE2", "quantize_available")
    if isinstance(library, str):
        return library
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.quantize_int4.argtypes = [pointer, ctypes.c_int, size, size, size, pointer, pointer, pointer]
    library.quantize_int8.argtypes = [pointer, ctypes.c_int, size, size, size, ctypes.c_float, pointer, pointer,
                                      pointer]
    library.dequantize.argtypes = [pointer, ctypes.c_int, size, size, size, pointer, pointer, pointer]
    return library


def unavailable_reason() -> str | None:
    """Why the native quantizers cannot run here, or None."""
    library = _library_or_reason()
    return library if isinstance(library, str) else None


def _native_input(w: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """`w` as the native pass reads it (a contiguous float32 or bfloat16 CPU matrix whose rows are whole
    groups), or None where the reference must run (it also raises the shape errors)."""
    if unavailable_reason() or w.device.type != "cpu" or w.dim() != 2 or group_size <= 0 \
            or w.shape[1] % group_size or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    return w.contiguous()


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kernels.wq_reference.quantize_int4`: (packed uint8 [N, K/2], scales, mins float16 [N, K/G])."""
    x = _native_input(w, group_size) if group_size % 2 == 0 else None
    if x is None:
        return wq_reference.quantize_int4(w, group_size)
    n, k = x.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.float16)
    mins = torch.empty_like(scales)
    _library_or_reason().quantize_int4(x.data_ptr(), x.dtype == torch.bfloat16, n, k, group_size,
                                       packed.data_ptr(), scales.data_ptr(), mins.data_ptr())
    return packed, scales, mins


def quantize_int8(w: torch.Tensor, group_size: int | None = None, bound: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.wq_reference.quantize_int8`: (q int8 [N, K], scales [N, K/G]: float32 per channel, else
    float16)."""
    g = w.shape[-1] if group_size is None else group_size
    x = _native_input(w, g) if 1 <= bound <= 127 else None
    if x is None:
        return wq_reference.quantize_int8(w, group_size, bound)
    n, k = x.shape
    q = torch.empty(n, k, dtype=torch.int8)
    per_channel = g == k
    scales = torch.empty(n, k // g, dtype=torch.float32 if per_channel else torch.float16)
    _library_or_reason().quantize_int8(x.data_ptr(), x.dtype == torch.bfloat16, n, k, g, float(bound), q.data_ptr(),
                                       scales.data_ptr() if per_channel else None,
                                       None if per_channel else scales.data_ptr())
    return q, scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """`kernels.wq_reference.dequantize`: float32 [N, K] weights from the stored format, written into `out` (a
    contiguous float32 [N, K]) where given: a buffer reused from weight to weight skips faulting in fresh pages,
    which took 2-3x the pass itself (an 8192 x 2048 weight on 2 cores of a VM: 21-27 ms against 8.4)."""
    packed_columns = qweight.shape[-1] * (2 if bits == 4 else 1)
    groups = scales.shape[-1] if scales.dim() == 2 else 0
    stored = {4: torch.uint8, 8: torch.int8}.get(bits)
    if out is not None and (out.dtype != torch.float32 or out.shape != (qweight.shape[0], packed_columns)
                            or not out.is_contiguous() or out.device != qweight.device):
        raise ValueError(f"dequantize's out must be a contiguous float32 {qweight.shape[0]} x {packed_columns} "
                         f"tensor on {qweight.device}")
    if unavailable_reason() or qweight.dtype != stored or qweight.dim() != 2 or qweight.device.type != "cpu" \
            or not groups or packed_columns % groups or (mins is not None and mins.shape != scales.shape):
        weight = wq_reference.dequantize(qweight, scales, mins, bits)
        return weight if out is None else out.copy_(weight)
    n, k = qweight.shape[0], packed_columns
    q = qweight.contiguous()
    s = scales.float().contiguous()
    m = None if mins is None else mins.float().contiguous()
    out = torch.empty(n, k) if out is None else out
    _library_or_reason().dequantize(q.data_ptr(), bits, n, k, k // groups, s.data_ptr(),
                                    None if m is None else m.data_ptr(), out.data_ptr())
    return out
