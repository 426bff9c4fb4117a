"""Triton GEMM for weight-only quantized linears: y[M, N] = x[M, K] @ W[N, K]^T.

One kernel serves int4 (W4A16) and int8 (W8A16): each program owns a BLOCK_M x BLOCK_N tile of y, walks K
in BLOCK_K steps, loads the packed weight tile, dequantizes it in registers (q * scale (+ min), float32)
and accumulates `tl.dot` in float32. The weight is never written out dequantized. Format: see
`kernels.wq_reference`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _wq_matmul_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K, G,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_ym, stride_yn,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & n_ok[None, :]  # weight tile is [BLOCK_K, BLOCK_N] (W transposed)
        if BITS == 4:
            byte = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None] // 2, mask=w_mask, other=0)
            q = (byte.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 0xF
        else:
            q = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=w_mask, other=0).to(tl.int32)
        s_off = rn[None, :] * stride_sn + rk[:, None] // G
        w = q.to(tl.float32) * tl.load(s_ptr + s_off, mask=w_mask, other=0.0).to(tl.float32)
        if HAS_MIN:
            w += tl.load(m_ptr + s_off, mask=w_mask, other=0.0).to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) by batch size. Decode (small M) is bandwidth-bound: narrow N tiles give
    more programs to stream the weight; 16 is tl.dot's smallest M. Untuned heuristics (bench/gpu_check.sh)."""
    if m <= 16:
        return 16, 32, 128
    return (32, 64, 64) if m <= 32 else (64, 64, 64)


def wq_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int
) -> torch.Tensor:
    """y = x W^T with the Triton kernel; x [..., K] in float16/bfloat16/float32, y in x's dtype."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.shape[1] * (2 if bits == 4 else 1) != k:
        raise ValueError(f"weight {tuple(qweight.shape)} ({bits}-bit) does not match input features {k}")
    if k % scales.shape[1]:
        raise ValueError(f"{scales.shape[1]} scale groups do not divide K={k}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    qweight, scales = qweight.contiguous(), scales.contiguous()
    has_min = mins is not None
    mins = mins.contiguous() if has_min else scales  # an unused pointer when HAS_MIN is off
    block_m, block_n, block_k = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _wq_matmul_kernel[grid](
        x2, qweight, scales, mins, y,
        m, n, k, k // scales.shape[1],
        x2.stride(0), x2.stride(1), qweight.stride(0), scales.stride(0), y.stride(0), y.stride(1),
        BITS=bits, HAS_MIN=has_min, DOT_FP32=x.dtype == torch.float32 or _interpreting(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)
