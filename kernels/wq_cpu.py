"""torch's CPU weight-only kernels behind the shared storage format.

`_weight_int4pack_mm_for_cpu` (int4, group-wise, w = (q - 8) * scale + zero) and `_weight_int8pack_mm`
(int8, one scale per output channel) are fast only with bfloat16 activations, and want their scales in
the activation dtype. Converting our format is exact up to the bfloat16 rounding of the scales:
w = q * s + m = (q - 8) * s + (m + 8 s), so zero = m + 8 s (computed in float32, then rounded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.wq_reference import group_size_of, unpack_int4

CPU_ACTIVATION_DTYPE = torch.bfloat16
_INNER_K_TILES = 2  # layout parameter of torch's int4 packing (the CPU kernel accepts 1, 2, 4 or 8)


@dataclass(frozen=True)
class CpuPacked:
    """Weights in the layout of a torch CPU kernel. int4: `weight` packed uint8, `scales` [K/G, N, 2]
    (scale, zero); int8: `weight` int8 [N, K], `scales` [N]."""

    bits: int
    weight: torch.Tensor
    scales: torch.Tensor
    group_size: int


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX); without it bf16 matmuls are
    emulated and lose to float32. oneDNN's own "bf16 supported" is not the test: it holds on any AVX-512
    CPU, where it emulates bf16 (an Intel Xeon with AVX-512 and VNNI but no AVX512-BF16 ran bf16
    `F.linear` at a fifth of float32's rate)."""
    cpu = torch.cpu
    return cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported()


def weight_only_kernels_fast() -> bool:
    """Whether torch's weight-only CPU kernels (bfloat16 activations) run vectorized here: wherever oneDNN
    supports bf16, which is any AVX-512 CPU, native bf16 or not (they convert bf16 in registers). On that
    Xeon without AVX512-BF16, a layer's four int4 products at one row took 0.28 ms against 0.55 ms in
    dense float32 and 6.8 ms dequantizing per call; on AVX2-only CPUs they lose to float32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_supports(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int) -> bool:
    """Whether a torch CPU kernel takes this weight: int4 with mins, N a multiple of 16 and groups of
    32, 64, 128 or 256; or int8 with one scale per output channel."""
    if bits == 4:
        k = qweight.shape[1] * 2
        groups = scales.shape[1]
        return mins is not None and qweight.shape[0] % 16 == 0 and k % groups == 0 and k // groups in (32, 64, 128, 256)
    return bits == 8 and mins is None and scales.shape[1] == 1


def pack_for_cpu(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> CpuPacked:
    """Our format -> the torch CPU kernel's, with scales in bfloat16 (the kernel's activation dtype)."""
    if not cpu_supports(qweight, scales, mins, bits):
        raise ValueError(
            "no torch CPU kernel for this weight (int4: mins, N % 16 == 0, group 32..256; int8: per-channel scales)"
        )
    dt = CPU_ACTIVATION_DTYPE
    if bits == 8:
        return CpuPacked(8, qweight.contiguous(), scales[:, 0].to(dt).contiguous(), qweight.shape[1])
    q = unpack_int4(qweight).to(torch.int32)
    group = group_size_of(q.shape[1], scales)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), _INNER_K_TILES)
    s = scales.float()
    zeros = s * 8 + mins.float()
    sz = torch.stack((s.T, zeros.T), dim=-1).to(dt).contiguous()
    return CpuPacked(4, packed, sz, group)


def cpu_matmul(x: torch.Tensor, packed: CpuPacked) -> torch.Tensor:
    """y = x W^T with torch's CPU kernel; x must be bfloat16."""
    if x.dtype != CPU_ACTIVATION_DTYPE:
        raise TypeError(f"the CPU quantized kernels take {CPU_ACTIVATION_DTYPE} activations, got {x.dtype}")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if packed.bits == 4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed.weight, packed.group_size, packed.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(x2, packed.weight, packed.scales)
    return y.reshape(*x.shape[:-1], y.shape[-1])
