"""Pick the weight-only matmul for where the activations live: Triton on CUDA, torch on CPU.

On CPU, weights already converted for torch's kernels (`CpuPacked`, bfloat16 activations) run there;
otherwise the weight is dequantized in float32 (bit-exact, the reference path) and multiplied densely.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
