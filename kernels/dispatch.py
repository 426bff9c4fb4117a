"""Pick the quantized matmul for where the activations live: Triton on CUDA, torch on CPU.

Weight-only: on CPU, weights already converted for torch's kernels (`CpuPacked`, bfloat16 activations) run
there; otherwise the weight is dequantized in float32 (bit-exact, the reference path) and multiplied densely.
W8A8 (`kernels.w8a8_reference`): on CPU `torch._int_mm` (oneDNN's int8 GEMM, VNNI/AMX where present) or,
where the model measured it faster, oneDNN's GEMM on a weight packed once (`kernels.packed_int8`); the Triton
int8 GEMM on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_quantize import dequantize
from kernels.packed_int8 import FULL_RANGE, packed_int8_products, weight_bound
from kernels.w8a8_reference import quantize_rows
from kernels.wq_cpu import CPU_ACTIVATION_DTYPE, CpuPacked, cpu_matmul


def wq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """y = x W^T for a weight in the shared format (`kernels.wq_reference`), in x's dtype."""
    if x.is_cuda:
        from kernels.wq_triton import wq_matmul_triton

        return wq_matmul_triton(x, qweight, scales, mins, bits)
    return F.linear(x, dequantize(qweight, scales, mins, bits).to(x.dtype))


def packed_matmul(x: torch.Tensor, packed: CpuPacked) -> torch.Tensor:
    """y = x W^T for a weight converted for torch's CPU kernels; other activation dtypes are cast."""
    return cpu_matmul(x.to(CPU_ACTIVATION_DTYPE), packed).to(x.dtype)


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor | None, wscale: torch.Tensor,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T with int8 x int8 products (int32 sums); qweight int8 [N, K] (or None on CPU with its oneDNN
    handle `packed`), wscale [N, 1]; y in x's dtype."""
    if x.is_cuda:
        from kernels.w8a8_triton import w8a8_matmul_triton

        return w8a8_matmul_triton(x, qweight, wscale)
    return int_mm_w8a8(x, qweight, wscale, packed)


def w8a8_weight_bound(device: torch.device) -> int:
    """The |int8 weight| W8A8 weights on `device` are quantized to: the full 127, or on CPU the bound
    oneDNN's packed GEMM multiplies exactly (`kernels.packed_int8.weight_bound`: 63 without VNNI), so that the
    faster GEMM stays open to them."""
    if device.type != "cpu":
        return FULL_RANGE
    try:
        return weight_bound()
    except RuntimeError:  # no packed GEMM: torch._int_mm takes the full range
        return FULL_RANGE


def int_mm_w8a8(x: torch.Tensor, qweight: torch.Tensor | None, wscale: torch.Tensor,
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 through `torch._int_mm` (oneDNN on CPU; cuBLASLt on CUDA, which needs more than 16 rows), or on
    CPU through the packed weight of handle `packed`: y = sums x weight scale x row scale."""
    q, sx = quantize_for_gemm(x.reshape(-1, x.shape[-1]), packed)
    y = int8_products(q, qweight, wscale, packed).mul_(sx)
    return y.to(x.dtype).reshape(*x.shape[:-1], wscale.shape[0])


def quantize_for_gemm(x: torch.Tensor, packed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)` as the GEMM that takes them wants them: uint8 with zero point 128 for a packed
    weight (handle `packed`), int8 for `torch._int_mm`."""
    return quantize_rows(x, zero_point=0 if packed is None else 128)


def int8_products(q: torch.Tensor, qweight: torch.Tensor | None, wscale: torch.Tensor,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """q int8 [M, K] (or for a packed weight uint8 q + 128, `quantize_for_gemm`) times an int8 weight [N, K],
    as stored or packed for oneDNN (`packed`, its handle): float32 [M, N], each int32 sum times its column's
    scale wscale [N, 1]. Both ways give the same bits
    (the sums are exact), so a model may pack some weights and not others."""
    return as_products(int8_outputs(q, qweight, wscale, packed), wscale.reshape(1, -1))


def int8_outputs(q: torch.Tensor, qweight: torch.Tensor | None, wscale: torch.Tensor,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """What the int8 GEMM of `int8_products` writes, before any elementwise work: `torch._int_mm`'s int32
    sums, or the packed GEMM's float32 products (its column scales are applied inside the kernel). A caller
    that only reduces over the products (the greedy head's maxima) reads these once instead of writing a
    float32 copy."""
    if packed is not None:
        return packed_int8_products(q, wscale.reshape(-1), packed)
    return torch._int_mm(q, qweight.t())


def as_products(outputs: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """`int8_outputs` (or columns gathered from them) as `int8_products`' values, bit for bit: int32 sums
    times their columns' scales `wscale` (broadcast to them); float32 products as they are."""
    return outputs if outputs.is_floating_point() else outputs.float().mul_(wscale)
