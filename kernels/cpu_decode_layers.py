"""Build and call `kernels/cpu_decode_layers.c`: decoder layers of a decode step (W8A8, or weight-only on the
W4A8 GEMM) in one native call.

The C structs (`kernels/cpu_kernels.h`) are mirrored here as ctypes structures, held to the compiler's
layout by tests/kernels/test_native_interface.py. A model fills one `Layer` per decoder layer once
(`pipeline.model.native_decode`), and each step one `Step`: the rows' RoPE tables, slots and block tables,
the kernels' entry points and scratch buffers.

Where it cannot run (no AVX-512 VNNI, no C compiler, `PIPELINE_NATIVE` leaving out `decode`), `unavailable_reason`
says why and the model keeps its compiled graphs.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import loaded_library

SOURCE = Path(__file__).with_name("cpu_decode_layers.c")
_pointer, _size = ctypes.c_void_p, ctypes.c_int64


class Linear(ctypes.Structure):
    """A W8A8 linear on the native GEMM: packed panels, zero-point correction, column scales, and the
    smoothing vector its input is multiplied by (None: none); its resident LoRA pairs stacked per slot,
    A^T [slots, k, lora_rank] divided by the smoothing vector along k and B^T scaled [slots, lora_rank, n]
    (None: no slot's adapter targets it), `lora_band` int32 [ceil(n / 16), 2] the ranks each 16 columns
    of B^T need (None: all), and `lora_a16` / `lora_b16` the pairs as AMX's bfloat16 tiles read them, for the
    tiles or AVX-512 BF16's dot products (`lora_bf16`; None: the float32 pairs' loops); `w4` the same weight in
    the W4A8 GEMM's int4 panels, which weight-only steps read (None: none); `bias` its bias (None: none; the
    layers add only qkv's)."""

    _fields_ = [("panels", _pointer), ("correction", _pointer), ("scale", _pointer), ("smooth", _pointer),
                ("n", _size), ("k", _size), ("lora_a", _pointer), ("lora_b", _pointer), ("lora_rank", _size),
                ("lora_band", _pointer), ("lora_a16", _pointer), ("lora_b16", _pointer), ("w4", _pointer),
                ("bias", _pointer)]


class Layer(ctypes.Structure):
    """One decoder layer: its norms' weights, four linears and KV pools (with scale pools for int8)."""

    _fields_ = [("input_norm", _pointer), ("post_norm", _pointer), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("k_pool", _pointer), ("v_pool", _pointer),
                ("k_scale", _pointer), ("v_scale", _pointer)]


class Step(ctypes.Structure):
    """What every layer of one step shares (`struct step` in kernels/cpu_kernels.h); `lora_slots` [rows]
    int64 each row's adapter slot (-1: base), None when no row has one, `lora_t` scratch of `lora_width`
    floats a row, `lora_x16` bfloat16 scratch for the bfloat16 pairs' inputs (`lora_x16_values`), `lora_tiles`
    1 where those pairs run on AMX's tiles, 0 on dot products; `gemm_w4` the W4A8 GEMM's entry point in a
    weight-only step (None: a W8A8 step)."""

    _fields_ = [("rows", _size), ("hidden", _size), ("heads", _size), ("kv_heads", _size), ("head_dim", _size),
                ("intermediate", _size), ("eps", ctypes.c_float), ("attention_scale", ctypes.c_float),
                ("cos", _pointer), ("sin", _pointer), ("slots", _pointer), ("tables", _pointer), ("lens", _pointer),
                ("first", _pointer), ("table_stride", _size), ("num_blocks", _size), ("gemm", _pointer),
                ("gemm_silu", _pointer), ("write", _pointer), ("decode", _pointer), ("u", _pointer), ("sx", _pointer),
                ("tmp", _pointer), ("qkv", _pointer), ("q", _pointer), ("attn", _pointer), ("gate_up", _pointer),
                ("proj", _pointer), ("lora_slots", _pointer), ("lora_t", _pointer), ("lora_width", _size),
                ("lora_x16", _pointer), ("lora_tiles", _size), ("gemm_w4", _pointer)]


def unavailable_reason() -> str | None:
    """Why the native decode layers cannot run here, or None."""
    library = _library_or_reason()
    return library if isinstance(library, str) else None


def decode_layers(layers: ctypes.Array, step: Step, x_address: int) -> float:
    """Run `layers` (an array of `Layer`) over the residual stream at x_address ([rows, hidden] float32,
    updated in place); returns the seconds spent in attention. Raises MemoryError where a GEMM could not
    allocate its padded rows."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native decode layers: {library}")
    seconds = ctypes.c_double(0.0)
    if library.decode_layers(layers, len(layers), ctypes.byref(step), x_address, ctypes.byref(seconds)):
        raise MemoryError(f"no memory for a padded copy of {step.rows} rows of GEMM activations")
    return seconds.value


def split_rows(step: Step, threads: int) -> list[int]:
    """Where a step of `step.rows` rows (lengths at step.lens, first keys at step.first) is split between
    `threads` threads, as `decode_layers` splits one large enough: thread i takes rows bounds[i] to
    bounds[i + 1] - 1, never splitting one sequence's rows of a prompt chunk."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native decode layers: {library}")
    bounds = (ctypes.c_int64 * (threads + 1))()
    library.split_rows(ctypes.byref(step), threads, bounds)
    return list(bounds)


def splits_by_rows(layer: Layer, rows: int, threads: int) -> bool:
    """Whether `decode_layers` splits a step of `rows` rows between `threads` threads by rows (each thread's
    rows through every layer on its own) rather than pass by pass: enough rows a thread, and layers whose
    int8 weights (the sizes in `layer`'s linears) are small enough that saving the passes' barriers beats
    reading every weight once per thread."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native decode layers: {library}")
    return bool(library.splits_by_rows(ctypes.byref(layer), rows, threads))


def lora_tiles() -> bool:
    """Whether the native layers' LoRA deltas can run on AMX's bfloat16 tiles here (the build has AMX-BF16, the
    CPU has it and Linux grants the tile state)."""
    library = _library_or_reason()
    return not isinstance(library, str) and bool(library.lora_tiles_available())


def lora_dots() -> bool:
    """Whether the native layers' LoRA deltas can run on AVX-512 BF16's dot products over the tiles' bfloat16
    pairs here (the build, for this CPU, has AVX-512 BF16): where AMX is absent, half the float32 loops'
    instructions."""
    library = _library_or_reason()
    return not isinstance(library, str) and bool(library.lora_dots_available())


def lora_x16_values(rows: int, widest: int, lora_width: int) -> int:
    """bfloat16 values of `Step.lora_x16` for `rows` rows whose widest linear input is `widest` and widest
    LoRA stack `lora_width`: each row's input, then its projections, up to a multiple of 32, and 16 rows more
    (a tile of the last rows reads 16 rows)."""
    return (rows + 16) * -(-max(widest, lora_width) // 32) * 32


def pack_tiles(t: torch.Tensor, k_multiple: int) -> torch.Tensor:
    """[slots, K, C] float as AMX's bfloat16 B operand: [slots, ceil(C / 16), Kp / 2, 16, 2] with K padded with
    zeros to Kp, a multiple of `k_multiple`, and C to a multiple of 16 (each 16 columns' values, pairs of rows
    side by side): `Linear.lora_a16` from A^T (k_multiple 32, a tile's depth), `lora_b16` from B^T (16: a
    rank-16 adapter's B^T in half the bytes; the caller adds a tile of zeros at the end)."""
    slots, k, c = t.shape
    kp, cp = -(-k // k_multiple) * k_multiple, -(-c // 16) * 16
    t = torch.nn.functional.pad(t, (0, cp - c, 0, kp - k))
    return t.view(slots, kp // 2, 2, cp // 16, 16).permute(0, 3, 1, 4, 2).to(torch.bfloat16).contiguous()


def lora_delta(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """y [T, n] plus each row's LoRA delta x [T, k] a[slot] b[slot] (a [slots, k, R], b [slots, R, n]; float32
    on CPU) for row t's slot slots[t] (int64; -1, or t past its end: none), as a new tensor: one pass over
    the rows where torch's gather, two batched matmuls and scatter-add pass over them several times."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native decode layers: {library}")
    x, y, a, b, slots = (t.contiguous() for t in (x, y, a, b, slots))
    out = torch.empty_like(y)
    library.lora_delta(x.data_ptr(), y.data_ptr(), out.data_ptr(), slots.data_ptr(), slots.shape[0], y.shape[0],
                       x.shape[1], y.shape[1], a.data_ptr(), b.data_ptr(), a.shape[2])
    return out


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.w8a8_reference.quantize_rows(x, zero_point=128)` bit for bit (uint8 [M, K], float32 scales
    [M, 1]; x float32 [M, K] on CPU), in one native pass: the native int8 head's input without a compiled graph
    (whose build took a second of every process's first step). A row with a NaN or an infinity gets a NaN
    scale, as the reference's."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native decode layers: {library}")
    x = x.float().contiguous()
    u = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    library.quantize_rows(x.data_ptr(), x.shape[0], x.shape[1], u.data_ptr(), scales.data_ptr())
    return u, scales


@cache
def _library_or_reason() -> ctypes.CDLL | str:
    """Built and loaded once per process; a failure is remembered too."""
    library = loaded_library(SOURCE, "decode", "avx512_vnni", "AVX-512 VNNI", "decode_layers_available")
    if isinstance(library, str):
        return library
    library.decode_layers.argtypes = [ctypes.POINTER(Layer), _size, ctypes.POINTER(Step), _pointer,
                                      ctypes.POINTER(ctypes.c_double)]
    library.decode_layers.restype = ctypes.c_int
    library.split_rows.argtypes = [ctypes.POINTER(Step), ctypes.c_int, ctypes.POINTER(ctypes.c_int64)]
    library.split_rows.restype = None
    library.splits_by_rows.argtypes = [ctypes.POINTER(Layer), _size, ctypes.c_int]
    library.splits_by_rows.restype = ctypes.c_int
    library.lora_delta.argtypes = [_pointer, _pointer, _pointer, _pointer, _size, _size, _size, _size, _pointer,
                                   _pointer, _size]
    library.lora_delta.restype = None
    library.quantize_rows.argtypes = [_pointer, _size, _size, _pointer, _pointer]
    library.quantize_rows.restype = None
    library.lora_tiles_available.restype = ctypes.c_int
    library.lora_dots_available.restype = ctypes.c_int
    return library
