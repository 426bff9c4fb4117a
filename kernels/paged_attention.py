"""Triton attention over the paged KV cache: decode (split-K, GQA), shared-prefix decode, prefill.

The pools are one [Hkv, num_blocks, block_size, D] tensor per layer for K and for V (the engine's layout);
every kernel reads keys and values in place through the block table, nothing is gathered into a buffer.

- `paged_decode`: one query token per sequence. A program owns (sequence, KV head, split): the query heads
  of that KV head are loaded together (GQA: each K/V block is read once for the whole group), and the
  sequence's blocks are divided among NUM_SPLITS programs (split-K) so a small batch of long contexts
  still fills the GPU. Each split writes a normalized partial output and its log-sum-exp; a reduction
  pass merges them exactly. The split is decided inside the kernel from the context length, so the grid
  depends only on the batch size (what a CUDA graph needs).
- Shared-prefix decode: rows whose block tables start with the same cached blocks read those blocks once
  for all their queries (`prefix_decode_partial`), the per-row pass starts after them (`start_blocks`),
  and the two partials merge by log-sum-exp like splits do.
- `paged_prefill`: the query rows of each (chunked) prefill sequence attend causally to all their keys
  in the cache (earlier chunks included); the chunk's own K/V must already be stored.
- A sliding window (`window`, Mistral's rule: the query at position p sees keys p - window < j <= p) is
  a runtime argument of the decode and prefill kernels: blocks wholly before a row's window are not read.
  Shared-prefix decode takes no window (the caller forms no prefix groups for a windowed model).

Arithmetic is float32 (scores, softmax, accumulation); the reference implementations are in
`kernels.paged_attention_reference`.
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _step_jit(*step_args: str):
    """`triton.jit` for a kernel whose `step_args` (the step's index arrays and table widths, which change
    from step to step) take no part in its specialization: Triton compiles a variant per integer that is 1
    or a multiple of 16 and per pointer 16-byte aligned or not, so each new combination would compile in
    the middle of a run. They are read as scalars: nothing is lost."""
    def wrap(fn):
        unknown = set(step_args) - set(inspect.signature(fn).parameters)
        if unknown:
            raise TypeError(f"{fn.__name__} has no parameters {sorted(unknown)}")
        return triton.jit(fn, do_not_specialize=step_args, do_not_specialize_on_alignment=step_args)
    return wrap


NO_WINDOW = 2**31 - 1  # the kernels' window argument for full attention: every key is within it


def _window_arg(window: int | None) -> int:
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be a positive number of positions, got {window}")
    return NO_WINDOW if window is None else window


@triton.jit
def _online_softmax_step(scores, m, l):  # noqa: E741
    """Shared by all kernels: fold a [Q, K] block of scores (-inf where masked) into the running max m and
    sum l; returns (p, alpha, m_new, l_new). Rows with every score -inf so far keep p = 0 (no NaN)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l_new = l * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _store_partial(o_ptrs, lse_ptrs, acc, m, l, mask_q, mask_o):  # noqa: E741
    """Normalized output and log-sum-exp (-inf and zeros for rows that saw no key)."""
    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    tl.store(o_ptrs, out.to(o_ptrs.dtype.element_ty), mask=mask_o)
    tl.store(lse_ptrs, tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l))), mask=mask_q)


@_step_jit("tables_ptr", "lens_ptr", "start_ptr", "stride_tb")
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, start_ptr, o_ptr, lse_ptr,
    scale, window,
    stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_tb,
    stride_os, stride_ob, stride_oh, stride_ls, stride_lb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    first_key = tl.maximum(ctx - window, 0)  # the query at ctx - 1 sees keys first_key..ctx - 1
    first = tl.maximum(tl.load(start_ptr + b), first_key // BLOCK_SIZE)
    end = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    per_split = (tl.maximum(end - first, 0) + NUM_SPLITS - 1) // NUM_SPLITS
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, end)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    heads = h * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for j in range(lo, hi):
        block = tl.load(tables_ptr + b * stride_tb + j).to(tl.int64)
        key_ok = (j * BLOCK_SIZE + t < ctx) & (j * BLOCK_SIZE + t >= first_key)
        offs = h.to(tl.int64) * stride_kh + block * stride_kb + t[:, None] * stride_kt + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_SIZE]
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        p, alpha, m, l = _online_softmax_step(scores, m, l)  # noqa: E741
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    o_ptrs = o_ptr + split * stride_os + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
    lse_ptrs = lse_ptr + split * stride_ls + b * stride_lb + heads
    _store_partial(o_ptrs, lse_ptrs, acc, m, l, g_ok, g_ok[:, None] & d_ok[None, :])


@_step_jit("prefix_tables_ptr", "prefix_blocks_ptr", "rows_ptr", "tile_group_ptr", "tile_row_ptr", "tile_end_ptr",
           "stride_pt")
def _prefix_kernel(
    q_ptr, k_ptr, v_ptr, prefix_tables_ptr, prefix_blocks_ptr, rows_ptr, tile_group_ptr, tile_row_ptr,
    tile_end_ptr, o_ptr, lse_ptr,
    scale,
    stride_qb, stride_qh, stride_kh, stride_kb, stride_kt, stride_pt, stride_ob, stride_oh, stride_lb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """Queries of up to BLOCK_R rows of one prefix group x the GROUP query heads of KV head h, over the
    group's shared blocks (all full: every key valid). The tile's batch rows are rows_ptr[first:end]."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    grp = tl.load(tile_group_ptr + tile)
    first = tl.load(tile_row_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    n_blocks = tl.load(prefix_blocks_ptr + grp)
    i = tl.arange(0, BLOCK_R * GROUP_PAD)
    member = first + i // GROUP_PAD
    heads = h * GROUP + i % GROUP_PAD
    q_ok = (member < end) & (i % GROUP_PAD < GROUP)
    rows = tl.load(rows_ptr + member, mask=member < end, other=0)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + rows[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_R * GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R * GROUP_PAD], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_R * GROUP_PAD, D_PAD], tl.float32)
    for j in range(0, n_blocks):
        block = tl.load(prefix_tables_ptr + grp * stride_pt + j).to(tl.int64)
        offs = h.to(tl.int64) * stride_kh + block * stride_kb + t[:, None] * stride_kt + d[None, :]
        k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        p, alpha, m, l = _online_softmax_step(scores, m, l)  # noqa: E741
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    o_ptrs = o_ptr + rows[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :]
    _store_partial(o_ptrs, lse_ptr + rows * stride_lb + heads, acc, m, l, q_ok, q_ok[:, None] & d_ok[None, :])


@_step_jit("num_parts")
def _merge_kernel(
    o_ptr, lse_ptr, out_ptr, num_parts,
    stride_os, stride_ob, stride_oh, stride_ls, stride_lb, stride_outb, stride_outh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):  # fmt: skip
    """out = sum_s exp(lse_s) o_s / sum_s exp(lse_s) for one (row, head): the exact softmax over the union
    of the parts' keys."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, PARTS_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_parts
    lse = tl.load(lse_ptr + s * stride_ls + b * stride_lb + h, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)
    o = tl.load(o_ptr + s[:, None] * stride_os + b * stride_ob + h * stride_oh + d[None, :],
                mask=s_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@_step_jit("tables_ptr", "query_start_ptr", "lens_ptr", "tile_seq_ptr", "tile_row_ptr", "stride_tb")
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, query_start_ptr, lens_ptr, tile_seq_ptr, tile_row_ptr, o_ptr,
    scale, window,
    stride_qt, stride_qh, stride_kh, stride_kb, stride_kt, stride_tb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    """BLOCK_M query rows of one sequence, one query head: causal attention over the cached keys (those
    within `window` positions of each row)."""
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    q_end = tl.load(query_start_ptr + seq + 1)
    ctx = tl.load(lens_ptr + seq)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    q_pos = ctx - (q_end - rows)  # positions of the query rows; keys 0..q_pos are visible
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + hq * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    last = tl.minimum(row0 + BLOCK_M, q_end) - 1
    n_blocks = (ctx - (q_end - last) + BLOCK_SIZE) // BLOCK_SIZE  # blocks up to the tile's last position
    first_block = tl.maximum(ctx - (q_end - row0) - window + 1, 0) // BLOCK_SIZE  # the first row's window
    for j in range(first_block, n_blocks):
        block = tl.load(tables_ptr + seq * stride_tb + j).to(tl.int64)
        k_pos = j * BLOCK_SIZE + t
        offs = h.to(tl.int64) * stride_kh + block * stride_kb + t[:, None] * stride_kt + d[None, :]
        kv_mask = (k_pos < ctx)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window) & row_ok[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        p, alpha, m, l = _online_softmax_step(scores, m, l)  # noqa: E741
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + hq * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _check_pools(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[int, int, int]:
    """(group, block_size, head_dim) after checking the shapes the kernels assume."""
    hkv, _, block_size, dim = k_pool.shape
    if v_pool.shape != k_pool.shape or k_pool.stride(-1) != 1 or v_pool.stride() != k_pool.stride():
        raise ValueError("K and V pools must share one [Hkv, num_blocks, block_size, D] layout, D contiguous")
    if q.shape[-1] != dim or q.shape[-2] % hkv or q.stride(-1) != 1:
        raise ValueError(f"queries {tuple(q.shape)} do not fit pools of {hkv} KV heads x {dim}")
    if block_size & (block_size - 1) or block_size < 16:
        raise ValueError(f"the Triton kernels need a power-of-two block size >= 16, got {block_size}")
    return q.shape[-2] // hkv, block_size, dim


# The split counts decode uses. Each is a compiled variant of the kernel (NUM_SPLITS is a constant), so
# there are few of them, all compiled when the GPU runner starts.
SPLIT_CHOICES = (1, 2, 4, 8, 16)


def decode_splits(batch_rows: int, num_kv_heads: int, max_blocks: int, num_sms: int) -> int:
    """How many programs share one sequence's blocks: the largest of SPLIT_CHOICES within what covers the GPU
    twice over and within the longest row's blocks (a split with nothing to read is wasted)."""
    programs = max(1, batch_rows * num_kv_heads)
    wanted = min(-(-2 * num_sms // programs), max_blocks)
    return max(s for s in SPLIT_CHOICES if s <= max(1, wanted))


def paged_decode_partial(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, start_blocks: torch.Tensor, o_parts: torch.Tensor, lse_parts: torch.Tensor,
    scale: float, window: int | None = None,
) -> None:
    """Fill o_parts [S, B, Hq, D] and lse_parts [S, B, Hq] (float32): split s of row b covers its share of
    blocks start_blocks[b] .. ceil(context_lens[b] / block_size) - 1, keys within `window` of the last."""
    group, block_size, dim = _check_pools(q, k_pool, v_pool)
    b, hq = q.shape[:2]
    splits = o_parts.shape[0]
    _decode_kernel[(b, hq // group, splits)](
        q, k_pool, v_pool, block_tables, context_lens, start_blocks, o_parts, lse_parts,
        scale, _window_arg(window),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        o_parts.stride(0), o_parts.stride(1), o_parts.stride(2), lse_parts.stride(0), lse_parts.stride(1),
        GROUP=group, GROUP_PAD=_pow2(group), HEAD_DIM=dim, D_PAD=_pow2(dim), BLOCK_SIZE=block_size,
        NUM_SPLITS=splits, num_warps=4,
    )  # fmt: skip


def prefix_decode_partial(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, prefix_tables: torch.Tensor,
    prefix_blocks: torch.Tensor, rows: torch.Tensor, tiles: torch.Tensor, o_part: torch.Tensor,
    lse_part: torch.Tensor, scale: float, rows_per_tile: int,
) -> None:
    """Fill o_part [B, Hq, D] / lse_part [B, Hq] for the rows of each prefix group over the group's shared
    blocks. prefix_tables [G, P] / prefix_blocks [G]: each group's blocks; rows: the groups' batch rows,
    one group after the other; tiles [3, T]: (group, first, end) of each tile, rows[first:end] being at
    most rows_per_tile rows of that group (see `prefix_tiles`)."""
    group, block_size, dim = _check_pools(q, k_pool, v_pool)
    hkv = q.shape[1] // group
    _prefix_kernel[(tiles.shape[1], hkv)](
        q, k_pool, v_pool, prefix_tables, prefix_blocks, rows, tiles[0], tiles[1], tiles[2], o_part, lse_part,
        scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), prefix_tables.stride(0),
        o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        GROUP=group, GROUP_PAD=_pow2(group), HEAD_DIM=dim, D_PAD=_pow2(dim), BLOCK_SIZE=block_size,
        BLOCK_R=rows_per_tile, DOT_FP32=q.dtype == torch.float32 or _interpreting(), num_warps=4,
    )  # fmt: skip


def prefix_rows_per_tile(group: int) -> int:
    """Rows of a group per prefix program: 64 query vectors (tl.dot wants at least 16)."""
    return max(1, 64 // _pow2(group))


def prefix_tiles(group_sizes: list[int], rows_per_tile: int) -> list[tuple[int, int, int]]:
    """(group index, first, end) tiles over the groups' rows laid out one group after the other."""
    tiles, lo = [], 0
    for g, size in enumerate(group_sizes):
        tiles += [(g, r, min(r + rows_per_tile, lo + size)) for r in range(lo, lo + size, rows_per_tile)]
        lo += size
    return tiles


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [B, Hq, D] = the exact merge of parts [S, B, Hq, D] with log-sum-exps [S, B, Hq]."""
    s, b, hq, dim = o_parts.shape
    _merge_kernel[(b, hq)](
        o_parts, lse_parts, out, s,
        o_parts.stride(0), o_parts.stride(1), o_parts.stride(2), lse_parts.stride(0), lse_parts.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=dim, D_PAD=_pow2(dim), PARTS_PAD=_pow2(s), num_warps=1,
    )  # fmt: skip
    return out


def paged_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, num_splits: int = 1, out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] (one token per sequence, its K/V already stored) over each row's
    context_lens[b] keys (the last `window` of them): [B, Hq, D] in q's dtype. num_splits > 1 splits each
    row's blocks (split-K)."""
    out = torch.empty_like(q) if out is None else out
    start = torch.zeros_like(context_lens)
    if num_splits == 1:  # the kernel's normalized output is the answer
        lse = torch.empty(1, *q.shape[:2], dtype=torch.float32, device=q.device)
        paged_decode_partial(q, k_pool, v_pool, block_tables, context_lens, start, out.unsqueeze(0), lse, scale,
                             window)
        return out
    o_parts = torch.empty(num_splits, *q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_splits, *q.shape[:2], dtype=torch.float32, device=q.device)
    paged_decode_partial(q, k_pool, v_pool, block_tables, context_lens, start, o_parts, lse, scale, window)
    return merge_partials(o_parts, lse, out)


def prefill_tiles(query_start: list[int], first_seq: int, block_m: int) -> list[tuple[int, int]]:
    """(sequence, first row) of each BLOCK_M tile over the query rows of sequences first_seq.. (host side)."""
    return [(b, r) for b in range(first_seq, len(query_start) - 1)
            for r in range(query_start[b], query_start[b + 1], block_m)]


def prefill_block_m() -> int:
    return 16 if _interpreting() else 64


def paged_prefill(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, context_lens: torch.Tensor, tiles: torch.Tensor, scale: float, block_m: int,
    out: torch.Tensor, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of flat query rows q [T, Hq, D]: sequence b owns rows query_start[b]:query_start[b+1]
    at positions context_lens[b] - n .. context_lens[b] - 1 (each seeing its last `window` keys). Only the
    rows covered by `tiles` [2, N] ((sequence, first row) pairs from `prefill_tiles`) are written into out."""
    group, block_size, dim = _check_pools(q, k_pool, v_pool)
    if tiles.shape[1] == 0:
        return out
    _prefill_kernel[(tiles.shape[1], q.shape[1])](
        q, k_pool, v_pool, block_tables, query_start, context_lens, tiles[0], tiles[1], out,
        scale, _window_arg(window),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=dim, D_PAD=_pow2(dim), BLOCK_SIZE=block_size, BLOCK_M=block_m,
        DOT_FP32=q.dtype == torch.float32 or _interpreting(), num_warps=4,
    )  # fmt: skip
    return out
