"""FP8 W8A8 linears (`model.quant=fp8`): float8_e4m3 weights with one scale per output channel, activations
quantized per token at run time, multiplied by `torch._scaled_mm` (FP8 tensor cores on Hopper / Ada).

y = (x / sx) W8^T * sx * sw: x's row scale sx = amax|x_row| / 448, W's row scale sw = amax|W_row| / 448,
448 being the largest float8_e4m3fn value. `fp8_matmul_reference` computes the same quantized product in
float32 (the ground truth for the kernel; the quantization error itself is measured against x W^T).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scaled float8: (q [R, C] float8_e4m3fn, scale [R, 1] float32) with t ~= q * scale."""
    amax = t.float().abs().amax(dim=-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    return (t.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight [N, K] -> (float8 [N, K], per-channel scales [N] float32)."""
    q, scale = quantize_fp8_rows(w)
    return q, scale[:, 0].contiguous()


def fp8_matmul(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """y = x W^T for x [..., K] (bfloat16/float16/float32), W as float8 [N, K] with scales [N]; y in x's dtype,
    rounded through bfloat16 (the kernel's output)."""
    k, n = x.shape[-1], wq.shape[0]
    x2 = x.reshape(-1, k)
    xq, x_scale = quantize_fp8_rows(x2)
    # bfloat16 out for every model dtype: a float16 output would overflow past 65504 inside the kernel
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, n), out_dtype=torch.bfloat16)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def fp8_matmul_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The same quantized product in float32: (q(x) sx) (q(W) sw)^T."""
    xq, x_scale = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    y = (xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).T
    return y.reshape(*x.shape[:-1], wq.shape[0])
