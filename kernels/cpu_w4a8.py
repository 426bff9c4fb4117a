"""The native W4A8 GEMM for small CPU steps (`kernels/cpu_w4a8_gemm.c`): int4 weights in groups of 32, packed
once at load, times activations quantized in the kernel to two int8 parts per group of 32 (the rounding and
its remainder).

Why: a decode step of a few rows reads every weight once, so it should run at memory bandwidth; torch's int4
CPU kernel (`kernels.wq_cpu`) reached ~3 GB/s of a ~27 GB/s machine at one row and its time grows with the
rows. `model.quant=auto` times this kernel against torch's at load and runs it where it is faster
(`pipeline.model.w8a8_crossover`). The weights are the int4 ones the load made (scales and mins as float16,
which the int4 and GGUF formats already are); the activations, in two int8 parts, keep about 14 bits of each
group's range: `w4a8_reference` is the arithmetic, and docs/quantization.md has its accuracy (one int8 part
alone cost SmolLM2 +1.1% perplexity, two -0.05%, as torch's W4A16 kernel's -0.10%).

Built by `kernels.native_build`; where it cannot run (no AVX-512 VNNI, no C compiler, `PIPELINE_NATIVE`
leaving out `w4a8`), `unavailable_reason` says why and the weight-only steps keep torch's kernel.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch

from kernels.native_build import function_address, loaded_library
from kernels.ops import define_op
from kernels.wq_reference import group_size_of, pack_int4, unpack_int4

SOURCE = Path(__file__).with_name("cpu_w4a8_gemm.c")
GROUP = 32  # k per weight group and per activation scale (GROUP in the C source)
PANEL = 32  # output channels per panel (NR)
HALF = 16  # k of a group in a byte's low nibble; the other 16 in its high one


def unavailable_reason() -> str | None:
    """Why the W4A8 GEMM cannot run here, or None."""
    library = _library_or_reason()
    return library if isinstance(library, str) else None


def gemm_address() -> int:
    """The GEMM's entry point (`w4a8_fn` in kernels/cpu_kernels.h), for the native decoder layers to call;
    RuntimeError where it cannot run."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native W4A8 GEMM: {library}")
    return function_address(library.w4a8_gemm)


def weight_reason(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> str | None:
    """Why an int4 weight in the shared format (`kernels.wq_reference`) cannot be packed for the kernel (it
    wants groups of 32 with mins, scales and mins within float16), or None."""
    k = qweight.shape[1] * 2
    if mins is None or group_size_of(k, scales) != GROUP:
        return f"W4A8 takes int4 groups of {GROUP} with mins"
    # all finite where the largest |value| is (a NaN propagates): one reduction, where isfinite().all() on
    # float16 took 3-5 ms a weight (~0.5 s of the 1B shape's first start)
    if not all(v.to(torch.float16).abs().amax().isfinite() for v in (scales, mins)):
        return "W4A8 keeps scales and mins in float16: these exceed its range"
    return None


@cache
def _library_or_reason() -> ctypes.CDLL | str:
    """Built and loaded once per process; a failure is remembered too."""
    library = loaded_library(SOURCE, "w4a8", "avx512_vnni", "AVX-512 VNNI", "w4a8_available")
    if isinstance(library, str):
        return library
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.w4a8_gemm.argtypes = [pointer, size, size, size, pointer, size, pointer]
    library.w4a8_gemm.restype = ctypes.c_int
    library.w4a8_pack.argtypes = [pointer, pointer, pointer, size, size, pointer]
    library.w4a8_pack.restype = None
    library.w4a8_unpack.argtypes = [pointer, size, size, pointer, pointer, pointer]
    library.w4a8_unpack.restype = None
    return library


def pack_w4a8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """An int4 weight [N, K] (qweight uint8 [N, K/2], scales and mins [N, K/32]) in the kernel's layout:
    uint8 [panels, K/32, 640] (the C source's header), packed natively where the kernel is built (else by
    `pack_w4a8_reference`). ValueError where `weight_reason` refuses it."""
    why_not = weight_reason(qweight, scales, mins)
    if why_not:
        raise ValueError(why_not)
    library = _library_or_reason()
    if isinstance(library, str):
        return pack_w4a8_reference(qweight, scales, mins)
    n, k = qweight.shape[0], qweight.shape[1] * 2
    q, s, m = (t.contiguous() for t in (qweight, scales.to(torch.float16), mins.to(torch.float16)))
    packed = torch.empty(-(-n // PANEL), k // GROUP, PANEL * GROUP // 2 + 4 * PANEL, dtype=torch.uint8)
    library.w4a8_pack(q.data_ptr(), s.data_ptr(), m.data_ptr(), n, k, packed.data_ptr())
    return packed


def pack_w4a8_reference(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """`pack_w4a8` in torch ops."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    panels, groups = -(-n // PANEL), k // GROUP
    pad = panels * PANEL - n
    q = torch.nn.functional.pad(unpack_int4(qweight), (0, 0, 0, pad))
    # [panel, vector j, channel c, group, half h, quad i, t] -> [panel, group, j, i, c, t]; k = 16 h + 4 i + t
    q = q.view(panels, 2, 16, groups, 2, 4, 4).permute(0, 3, 4, 1, 5, 2, 6)
    nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(panels, groups, -1)

    def halves(values: torch.Tensor) -> torch.Tensor:  # [N, groups] -> float16 bytes [panels, groups, 64]
        padded = torch.nn.functional.pad(values.to(torch.float16), (0, 0, 0, pad))
        return padded.view(panels, PANEL, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((nibbles, halves(scales), halves(mins)), dim=-1).contiguous()


def unpack_w4a8(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_w4a8`: (qweight uint8 [N, K/2], scales, mins float16 [N, K/32]) of the first
    `out_features` channels, exactly the int4 weight packed (its scales and mins as float16): another layout
    of it is made from this one where needed rather than made, stored and read at every load. Native where
    the kernel is built (else `unpack_w4a8_reference`)."""
    library = _library_or_reason()
    if isinstance(library, str):
        return unpack_w4a8_reference(packed, out_features)
    k = packed.shape[1] * GROUP
    qweight = torch.empty(out_features, k // 2, dtype=torch.uint8)
    scales = torch.empty(out_features, k // GROUP, dtype=torch.float16)
    mins = torch.empty_like(scales)
    library.w4a8_unpack(packed.contiguous().data_ptr(), out_features, k, qweight.data_ptr(), scales.data_ptr(),
                        mins.data_ptr())
    return qweight, scales, mins


def unpack_w4a8_reference(packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`unpack_w4a8` in torch ops."""
    panels, groups = packed.shape[0], packed.shape[1]
    nibbles = packed[..., :512].reshape(panels, groups, 2, 4, PANEL // 2, 4)  # [panel, group, j, i, c, t]
    q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=2)  # [panel, group, h, j, i, c, t]
    q = q.permute(0, 3, 5, 1, 2, 4, 6).reshape(panels * PANEL, groups * GROUP)[:out_features]

    def values(start: int) -> torch.Tensor:  # float16 bytes [panels, groups, 64] -> [N, groups]
        half = packed[..., start:start + 2 * PANEL].contiguous().view(torch.float16)
        return half.transpose(1, 2).reshape(panels * PANEL, groups)[:out_features]

    return pack_int4(q), values(512), values(512 + 2 * PANEL)


def _matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The operator's CPU implementation: float32 x [M, K] times the packed weight -> float32 [M, N]."""
    library = _library_or_reason()
    if isinstance(library, str):
        raise RuntimeError(f"no native W4A8 GEMM: {library}")
    x = x.float().contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0] and library.w4a8_gemm(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(),
                                        out_features, out.data_ptr()):
        raise MemoryError(f"no memory for {x.shape[0]} x {x.shape[1]} quantized activations")
    return out


_w4a8_op = define_op("w4a8_matmul", "(Tensor x, Tensor packed, int out_features) -> Tensor", _matmul,
                     lambda x, packed, out_features: x.new_empty(x.shape[0], out_features, dtype=torch.float32))


def w4a8_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """y = x W^T (in x's dtype, any leading dimensions) for a weight packed by `pack_w4a8`; a call that
    compiled graphs keep as one operator."""
    if packed.dim() != 3 or packed.shape[1] * GROUP != x.shape[-1] or packed.shape[0] * PANEL < out_features:
        raise ValueError(f"a packed W4A8 weight {tuple(packed.shape)} does not take {x.shape[-1]} inputs to "
                         f"{out_features} outputs")
    y = _w4a8_op(x.reshape(-1, x.shape[-1]), packed, out_features)
    return y.to(x.dtype).reshape(*x.shape[:-1], out_features)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float x [M, K] -> (int8 q [M, K], float32 steps [M, K/32]): per group of 32, step max|x| / 127 (1 where
    that is 0) and q = round(x / step), as the kernel rounds each part."""
    xg = x.float().unflatten(-1, (-1, GROUP))
    step = xg.abs().amax(-1).div(127)
    step = torch.where(step == 0, torch.ones_like(step), step)
    return torch.round(xg / step.unsqueeze(-1)).flatten(-2).to(torch.int8), step


def activation_parts(x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float x [M, K] -> the kernel's two int8 parts, each (q, steps): x rounded per group, then the remainder
    x - q step (computed exactly, rounded once to float32) rounded the same way."""
    q, step = quantize_groups(x)
    rest = (x.double() - q.double() * step.double().repeat_interleave(GROUP, dim=-1)).float()
    return [(q, step), quantize_groups(rest)]


def w4a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in plain torch, float32 [M, N]: exact per-group integer sums of each activation
    part and the int4 weights, times the part's steps and the weight scales (float16), plus the weight mins
    times the float activations' group sums."""
    w = unpack_int4(qweight).double().unflatten(-1, (-1, GROUP))  # [N, G, 32]
    s, m = scales.to(torch.float16).double(), mins.to(torch.float16).double()
    y = x.double().unflatten(-1, (-1, GROUP)).sum(-1) @ m.T
    for q, step in activation_parts(x):
        dots = torch.einsum("mgk,ngk->mng", q.double().unflatten(-1, (-1, GROUP)), w)  # exact: integers < 2^53
        y = y + (dots * step.double().unsqueeze(1) * s.unsqueeze(0)).sum(-1)
    return y.float()
