"""Pick the quantized matmul for where the activations live: Triton on CUDA, torch on CPU.

Weight-only: on CPU, weights already converted for torch's kernels (`CpuPacked`, bfloat16 activations) run
there; otherwise the weight is dequantized in float32 (bit-exact, the reference path) and multiplied densely.
W8A8 (`kernels.w8a8_reference`): `torch._int_mm` on CPU (oneDNN's int8 GEMM, VNNI/AMX where present),
the Triton int8 GEMM on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.w8a8_reference import quantize_rows
from kernels.wq_cpu import CPU_ACTIVATION_DTYPE, CpuPacked, cpu_matmul
from kernels.wq_reference import dequantize


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


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """y = x W^T with int8 x int8 products (int32 sums); qweight int8 [N, K], wscale [N, 1]; y in x's dtype."""
    if x.is_cuda:
        from kernels.w8a8_triton import w8a8_matmul_triton

        return w8a8_matmul_triton(x, qweight, wscale)
    return int_mm_w8a8(x, qweight, wscale)


def int_mm_w8a8(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """W8A8 through `torch._int_mm` (oneDNN on CPU; cuBLASLt on CUDA, which needs more than 16 rows)."""
    acc, sx = int_mm_w8a8_sums(x.reshape(-1, x.shape[-1]), qweight)
    y = dequantize_sums(acc, sx, wscale.reshape(1, -1))
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def int_mm_w8a8_sums(x: torch.Tensor, qweight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float quantized per row, times qweight int8 [N, K]: the int32 sums [M, N] and the rows'
    scales [M, 1]; y = sums * row scale * weight scale (`int_mm_w8a8`)."""
    q, sx = quantize_rows(x)
    return torch._int_mm(q, qweight.t()), sx


def dequantize_sums(sums: torch.Tensor, row_scales: torch.Tensor, weight_scales: torch.Tensor) -> torch.Tensor:
    """float32 W8A8 outputs from int32 sums: sums x row scale x weight scale, in that order, so that every
    caller (a whole output, or a few columns of it recomputed) rounds alike. One pass, the scales in place."""
    return sums.float().mul_(row_scales).mul_(weight_scales)
