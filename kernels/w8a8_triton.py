"""Triton int8 GEMM for W8A8 linears: y[M, N] = (q_x[M, K] @ q_w[N, K]^T) * s_x[M] * s_w[N].

Each program owns a BLOCK_M x BLOCK_N tile, accumulates int8 x int8 `tl.dot` in int32 over K and applies
both scales in the epilogue, writing y once in the activation dtype. The activations are quantized per
row before the GEMM by one kernel (`quantize_rows_triton`: a program per row reads it twice, for its
absmax and to round it) where torch's ops take seven; its int8 values and scales are exactly
`kernels.w8a8_reference.quantize_rows`'s (IEEE division, ties to even). Arithmetic: see that module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: IEEE division, as torch's (Triton's `/` on float32 need not round correctly)
    scale = tl.math.div_rn(tl.max(amax, 0), tl.full((), 127.0, tl.float32))
    scale = tl.where(scale == 0.0, 1.0, scale)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
        v = tl.math.div_rn(x, tl.zeros_like(x) + scale)
        r = tl.floor(v + 0.5)  # exact: |v| <= 127 leaves the half-step representable
        odd = r - 2.0 * tl.floor(r * 0.5)
        r = tl.where((r - v == 0.5) & (odd != 0.0), r - 1.0, r)  # ties to even, as torch.round
        tl.store(q_ptr + row * stride_qm + rk, r.to(tl.int8), mask=rk < K)
    tl.store(s_ptr + row, scale)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows(x)` (int8 values, float32 scales [M, 1]) in one kernel; x [M, K] with unit K stride."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                    BLOCK_K=min(triton.next_power_of_2(k), 2048), num_warps=4)
    return q, scale


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
    q, sx = quantize_rows_triton(x2)
    qweight = qweight.contiguous()
    sw = wscale.float().reshape(-1).contiguous()
    block_m, block_n, block_k = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_kernel[grid](
        q, qweight, sx.reshape(-1).contiguous(), sw, y, m, n, k, q.stride(0), qweight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
