"""W8A8: int8 weights (one scale per output channel) times int8 activations (one scale per token).

The weight is `kernels.wq_reference`'s int8 format with G = K (`quantize_int8(w)`): q_w [N, K] int8 and
s_w [N, 1]; on CPUs whose int8 kernels sum pairs in int16, within -63..63
(`kernels.dispatch.w8a8_weight_bound`). Activations are quantized on the fly, per row, symmetric absmax:
s_x = max|x| / 127 and q_x = round(x / s_x) in -127..127. The product is accumulated exactly in int32 and scaled once:
y[m, n] = (sum_k q_x[m, k] q_w[n, k]) * s_x[m] * s_w[n]. Every W8A8 kernel computes exactly this.
"""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor, zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q [M, K], scale float32 [M, 1]); an all-zero row gets scale 1 (q = 0). q is int8
    (zero_point 0) or, with zero_point=128, uint8 q + 128: the input oneDNN's u8 x s8 GEMM takes
    (`kernels.packed_int8`), rounded straight to it so that a compiled step writes it in its vectorized
    rounding loop."""
    if zero_point not in (0, 128):
        raise ValueError(f"quantize_rows: zero_point must be 0 (int8) or 128 (uint8), got {zero_point}")
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).div_(127)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # |x / scale| <= 127 up to one rounding of scale, so the rounded value is within -127..127: no clamp pass.
    q = torch.round(xf / scale)
    return (q.to(torch.int8) if zero_point == 0 else (q + 128).to(torch.uint8)), scale


def w8a8_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """y = x W^T in the W8A8 arithmetic above. The integer dot products are float64 matmuls: exact, since
    every partial sum is an integer below K * 2^14 < 2^53, and unlike an int64 matmul they run on CUDA."""
    x2 = x.reshape(-1, x.shape[-1])
    q, s = quantize_rows(x2)
    acc = q.double() @ qweight.double().T
    y = acc * s.double() * wscale.double().reshape(1, -1)
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
