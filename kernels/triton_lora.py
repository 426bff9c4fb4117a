"""Triton segmented LoRA deltas (SGMV): y[t] += x[t] @ A_s @ B_s for each token t of a slot-s run, every
adapter of a step in one launch per stage, the base GEMM left to the linear.

Why two stages (shrink, expand) and not one: the rank is small, so x @ A (shrink, [T, in] -> [T, R]) is a
reduction over the long input axis and h @ B (expand, [T, R] -> [T, out]) a wide product over a short one.
Each stage gets the grid its shape wants; h lives in a float32 [T, R] buffer between them (T x R floats, a
sliver of the activations), so the intermediate is never rounded to the model's dtype.

The step's runs are cut into tiles of at most `BLOCK_M` rows of one slot (`segment_tiles`, once per step);
a program owns one tile (and, in expand, one block of output columns), reads its slot and multiplies by that
slot's stacked pair, so the grid is exactly the adapter tokens' row blocks: no padding to the longest run,
no program for base-model tokens. Pairs are the resident stacks of `pipeline.model.lora.table.LoraTable`:
A^T [slots, in, R] and B^T scaled [slots, R, out], zero past each slot's rank, so one rank block
(`BLOCK_R`, the stack's width rounded up to a power of two, at least 16 for `tl.dot`) serves every slot,
and a slot whose adapter does not target the linear adds zeros. Decode steps have few tiles and a long
input axis: shrink then splits it (split-K, float32 partials added atomically into h).

Accumulation is float32; inputs float32 (ieee dots), bfloat16 or float16 (tensor-core dots for shrink,
expand's dot on the float32 h and B widened, tf32). `lora_delta_reference` is the per-token torch
reference the tests compare with.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# rows a tile holds: tl.dot's smallest M (a decode run of one token still fills a 16-row tile, masked)
BLOCK_M = 16
BLOCK_K = 64  # input features per shrink step
BLOCK_N = 64  # output features per expand program


@triton.jit
def _tile(tiles_ptr, n_tiles, tile):
    """The tile's first row, end row and slot, from the [3, n_tiles] table."""
    start = tl.load(tiles_ptr + tile)
    end = tl.load(tiles_ptr + n_tiles + tile)
    slot = tl.load(tiles_ptr + 2 * n_tiles + tile)
    return start, end, slot


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, tiles_ptr, n_tiles, K, R,
    stride_xt, stride_xk, stride_as, stride_ak, stride_ar, stride_ht, stride_hr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    start, end, slot = _tile(tiles_ptr, n_tiles, tl.program_id(0))
    pid_k = tl.program_id(1)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_lo = pid_k * per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + per_split * BLOCK_K, K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + rk[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        a = tl.load(a_base + rk[:, None] * stride_ak + rr[None, :] * stride_ar, mask=k_ok[:, None] & r_ok[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a)
    h_ptrs = h_ptr + rows[:, None] * stride_ht + rr[None, :] * stride_hr
    h_ok = row_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=h_ok)
    else:
        tl.atomic_add(h_ptrs, acc, mask=h_ok)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, tiles_ptr, n_tiles, N, R,
    stride_ht, stride_hr, stride_bs, stride_br, stride_bn, stride_yt, stride_yn,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    start, end, slot = _tile(tiles_ptr, n_tiles, tl.program_id(0))
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    h = tl.load(h_ptr + rows[:, None] * stride_ht + rr[None, :] * stride_hr, mask=row_ok[:, None] & r_ok[None, :],
                other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rr[:, None] * stride_br + rn[None, :] * stride_bn,
                mask=r_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(h, b, input_precision="ieee") if IEEE else tl.dot(h, b, input_precision="tf32")
    y_ptrs = y_ptr + rows[:, None] * stride_yt + rn[None, :] * stride_yn
    y_ok = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptrs, mask=y_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=y_ok)


def segment_tiles(segments: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """The runs (first token, end token, slot) cut into tiles of at most BLOCK_M rows: int32 [3, tiles]
    (first rows, end rows, slots) on `device`, built once per step and shared by all its linears."""
    cuts = [(s, min(s + BLOCK_M, end), slot) for start, end, slot in segments for s in range(start, end, BLOCK_M)]
    return torch.tensor(cuts, dtype=torch.int32).reshape(-1, 3).t().contiguous().to(device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def split_k_for(tiles: int, k: int, device: torch.device) -> int:
    """Shrink programs per tile so that about two waves cover the GPU, each keeping >= 4 K steps."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, tiles), triton.cdiv(k, BLOCK_K) // 4, 16))


def lora_add_(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tiles: torch.Tensor,
    split_k: int | None = None,
) -> torch.Tensor:
    """y [T, out] (updated in place and returned) plus each tile's rows' deltas x @ a[slot] @ b[slot];
    x [T, in], a [slots, in, R], b [slots, R, out], all one dtype; tiles from `segment_tiles`.
    split_k: shrink programs per tile along `in` (None: chosen from the shape and the GPU)."""
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, in] and [T, out]")
    if a.shape[1] != x.shape[1] or b.shape[2] != y.shape[1] or a.shape[2] != b.shape[1] or a.shape[0] != b.shape[0]:
        raise ValueError(f"pairs {tuple(a.shape)}, {tuple(b.shape)} do not fit x {tuple(x.shape)} -> y {tuple(y.shape)}")
    if not x.dtype == y.dtype == a.dtype == b.dtype:
        raise ValueError(f"x, y, a, b must share a dtype, got {x.dtype}, {y.dtype}, {a.dtype}, {b.dtype}")
    n_tiles, (k, r), n = tiles.shape[1], a.shape[1:], y.shape[1]
    if n_tiles == 0 or r == 0:
        return y
    block_r = max(16, triton.next_power_of_2(r))
    # fp32 models get ieee dots; so does the interpreter, whose bfloat16 tl.dot returns garbage
    ieee = x.dtype == torch.float32 or _interpreting()
    split = split_k or split_k_for(n_tiles, k, x.device)
    h = (torch.zeros if split > 1 else torch.empty)(x.shape[0], r, dtype=torch.float32, device=x.device)
    _shrink_kernel[(n_tiles, split)](
        x, a, h, tiles, n_tiles, k, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        SPLIT_K=split, IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=block_r,
    )  # fmt: skip
    _expand_kernel[(n_tiles, triton.cdiv(n, BLOCK_N))](
        h, b, y, tiles, n_tiles, n, r,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r,
    )  # fmt: skip
    return y


def lora_delta_reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """A new tensor: y with y[t] += x[t] @ a[s] @ b[s] for each token t of slot s = slots[t] (-1: none),
    token by token in float32, rounded once to y's dtype."""
    out = y.to(torch.float32, copy=True)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += x[t].float() @ a[s].float() @ b[s].float()
    return out.to(y.dtype)
