"""Triton int8 GEMM for W8A8 linears: y[M, N] = (q_x[M, K] @ q_w[N, K]^T) * s_x[M] * s_w[N].

Each program owns a BLOCK_M x BLOCK_N tile, accumulates int8 x int8 `tl.dot` in int32 over K and applies
both scales in the epilogue, writing y once in the activation dtype. The activations are quantized per
row before the call (`kernels.w8a8_reference.quantize_rows`). Arithmetic: see that module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.w8a8_reference import quantize_rows


@triton.jit
def _w8a8_kernel(
    x_ptr, w_ptr, sx_ptr, sw_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(x, w, out_dtype=tl.int32)
    sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * sx[:, None] * sw[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 is tl.dot's smallest M; untuned heuristics like kernels.wq_triton's."""
    return (16, 64, 64) if m <= 16 else (64, 64, 64)


def w8a8_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor) -> torch.Tensor:
    """y = x W^T (W8A8) with the Triton kernel; x [..., K] float, qweight int8 [N, K], wscale [N, 1]."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.shape[1] != k or qweight.dtype != torch.int8:
        raise ValueError(f"weight {tuple(qweight.shape)} {qweight.dtype} does not match int8 with K={k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    q, sx = quantize_rows(x2)
    qweight = qweight.contiguous()
    sw = wscale.float().reshape(-1).contiguous()
    block_m, block_n, block_k = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](
        q, qweight, sx.reshape(-1).contiguous(), sw, y, m, n, k, q.stride(0), qweight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
