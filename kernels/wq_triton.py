"""Triton GEMM for weight-only quantized linears: y[M, N] = x[M, K] @ W[N, K]^T.

One kernel serves int4 (W4A16) and int8 (W8A16). Each program owns a BLOCK_M x BLOCK_N tile of y and a
share of K (split-K: SPLIT_K programs per tile, their float32 partials summed afterwards), walks it in
BLOCK_K steps, dequantizes the weight tile in float32 registers and accumulates `tl.dot` in float32; the
weight is never written out dequantized. With bfloat16 / float16 activations the dequantized tile is
rounded to that dtype for the tensor-core dot (the same rounding a bf16 model's own weights carry); with
float32 activations the dot is float32 throughout. Format: see `kernels.wq_reference`.

- int4: each packed byte is loaded once; its low nibbles (even k) and high nibbles (odd k) are two
  [BLOCK_K/2, BLOCK_N] tiles multiplied with the even and odd columns of x.
- Scales (and mins) are loaded once per tile and group: a tile never straddles a group (BLOCK_K divides
  the group size, or the whole row is one group).
- Small M (decode) leaves most of the GPU idle with one program per output tile: split-K gives each tile
  several programs. BLOCK_N, warps and stages are autotuned per (M bucket, N, K, split) on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _wq_matmul_kernel(
    x_ptr, q_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K, G, M_BUCKET,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_ys, stride_ym, stride_yn,
    BITS: tl.constexpr, HAS_MIN: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_lo = pid_k * per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + per_split * BLOCK_K, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    HALF: tl.constexpr = BLOCK_K // 2
    for k0 in range(k_lo, k_hi, BLOCK_K):
        s_off = rn * stride_sn + k0 // G  # the tile's one group
        scale = tl.load(s_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_MIN:
            low = tl.load(m_ptr + s_off, mask=n_ok, other=0.0).to(tl.float32)
        if BITS == 4:
            rb = k0 // 2 + tl.arange(0, HALF)  # byte columns of this tile
            b_ok = rb * 2 < K
            byte = tl.load(q_ptr + rn[None, :] * stride_qn + rb[:, None], mask=b_ok[:, None] & n_ok[None, :],
                           other=0).to(tl.int32)  # [HALF, BLOCK_N], each byte once
            w_even = (byte & 0xF).to(tl.float32) * scale[None, :]
            w_odd = ((byte >> 4) & 0xF).to(tl.float32) * scale[None, :]
            if HAS_MIN:
                w_even += low[None, :]
                w_odd += low[None, :]
            x_mask = m_ok[:, None] & b_ok[None, :]
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + (rb * 2)[None, :] * stride_xk, mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (rb * 2 + 1)[None, :] * stride_xk, mask=x_mask,
                            other=0.0)
            if DOT_FP32:
                acc += tl.dot(x_even.to(tl.float32), w_even, input_precision="ieee")
                acc += tl.dot(x_odd.to(tl.float32), w_odd, input_precision="ieee")
            else:
                acc += tl.dot(x_even, w_even.to(x_even.dtype))
                acc += tl.dot(x_odd, w_odd.to(x_odd.dtype))
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            q = tl.load(q_ptr + rn[None, :] * stride_qn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            w = q.to(tl.float32) * scale[None, :]
            if HAS_MIN:
                w += low[None, :]
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    y_ptrs = y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# Tuned on the GPU per (M bucket, N, K, split); the interpreter runs the first.
_CONFIGS = [
    triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s)
    for bn, w, s in ((64, 4, 4), (32, 4, 4), (128, 4, 3), (64, 8, 3), (128, 8, 4))
]
_tuned_kernel = triton.autotune(_CONFIGS, key=["M_BUCKET", "N", "K", "SPLIT_K", "BLOCK_M", "BLOCK_K"])(_wq_matmul_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_m_for(m: int) -> int:
    """16 is tl.dot's smallest M; larger batches take larger tiles."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def block_k_for(k: int, group: int) -> int:
    """The largest of 128/64/32 that keeps a tile inside one group (any, when the row is one group)."""
    if group == k:
        return 128
    for bk in (128, 64, 32):
        if group % bk == 0:
            return bk
    raise ValueError(f"group size {group} is not a multiple of 32: no tile fits inside a group")


def split_k_for(m: int, n: int, k: int, block_k: int, num_sms: int) -> int:
    """Programs per output tile so that about two waves cover the GPU, keeping >= 4 K tiles per program."""
    tiles = triton.cdiv(m, block_m_for(m)) * triton.cdiv(n, 64)
    if tiles >= num_sms:
        return 1
    return max(1, min(triton.cdiv(2 * num_sms, tiles), triton.cdiv(k, block_k) // 4, 16))


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def wq_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """y = x W^T with the Triton kernel; x [..., K] in float16/bfloat16/float32, y in x's dtype.
    split_k: programs per output tile along K (None: chosen from the shape and the GPU)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    k = x.shape[-1]
    n = qweight.shape[0]
    if qweight.shape[1] * (2 if bits == 4 else 1) != k:
        raise ValueError(f"weight {tuple(qweight.shape)} ({bits}-bit) does not match input features {k}")
    if k % scales.shape[1]:
        raise ValueError(f"{scales.shape[1]} scale groups do not divide K={k}")
    group = k // scales.shape[1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    qweight, scales = qweight.contiguous(), scales.contiguous()
    has_min = mins is not None
    mins = mins.contiguous() if has_min else scales  # an unused pointer when HAS_MIN is off
    block_m, block_k = block_m_for(m), block_k_for(k, group)
    split = split_k or split_k_for(m, n, k, block_k, _num_sms(x.device))
    # One split writes y directly; several write float32 partials, summed below.
    y = torch.empty(split, m, n, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    args = (
        x2, qweight, scales, mins, y, m, n, k, group, triton.next_power_of_2(m),
        x2.stride(0), x2.stride(1), qweight.stride(0), scales.stride(0), y.stride(0), y.stride(1), y.stride(2),
    )
    meta = dict(BITS=bits, HAS_MIN=has_min, DOT_FP32=x.dtype == torch.float32 or _interpreting(), SPLIT_K=split,
                BLOCK_M=block_m, BLOCK_K=block_k)
    if _interpreting():
        _wq_matmul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, 64), split)](*args, **meta, BLOCK_N=64)
    else:
        _tuned_kernel[lambda cfg: (triton.cdiv(m, block_m), triton.cdiv(n, cfg["BLOCK_N"]), split)](*args, **meta)
    out = y[0] if split == 1 else y.sum(0).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)
