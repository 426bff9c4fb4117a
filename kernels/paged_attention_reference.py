"""Plain-torch references for `kernels.paged_attention`: each sequence's keys gathered out of the pool in
position order, then matmul-softmax-matmul in float32. Slow and obvious on purpose (the tests' ground truth).
"""

from __future__ import annotations

import torch


def gather_keys(pool: torch.Tensor, table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """Positions first..end-1 of one sequence from a [Hkv, num_blocks, block_size, D] pool -> [Hkv, L, D]."""
    block_size = pool.shape[2]
    pos = torch.arange(first, end, device=pool.device)
    return pool[:, table[pos // block_size].long(), pos % block_size].float()


def attention_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] over keys/values [Hkv, L, D] (visible [n, L] or all): normalized output [n, Hq, D]
    float32 and log-sum-exp [n, Hq] (-inf and zeros where no key is visible)."""
    n, hq, dim = q.shape
    hkv = keys.shape[0]
    if keys.shape[1] == 0:
        return torch.zeros(n, hq, dim, device=q.device), torch.full((n, hq), float("-inf"), device=q.device)
    heads = torch.arange(hq, device=q.device) // (hq // hkv)
    scores = torch.einsum("nhd,hld->nhl", q.float(), keys[heads]) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
    return torch.einsum("nhl,hld->nhd", probs, values[heads]), lse


def paged_decode_reference(q, k_pool, v_pool, block_tables, context_lens, scale, window=None) -> torch.Tensor:
    """[B, Hq, D] in q's dtype: row b's query over its context_lens[b] keys (the last `window` of them)."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        first = 0 if window is None else max(0, length - window)
        keys = gather_keys(k_pool, block_tables[b], first, length)
        values = gather_keys(v_pool, block_tables[b], first, length)
        out[b] = attention_part(q[b : b + 1], keys, values, scale)[0][0].to(q.dtype)
    return out


def decode_part_reference(q, k_pool, v_pool, block_tables, context_lens, start_blocks, scale):
    """(o [B, Hq, D], lse [B, Hq]) of each row over its keys from block start_blocks[b] on."""
    bs = k_pool.shape[2]
    outs, lses = [], []
    for b, (length, first) in enumerate(zip(context_lens.tolist(), start_blocks.tolist())):
        keys = gather_keys(k_pool, block_tables[b], first * bs, length)
        values = gather_keys(v_pool, block_tables[b], first * bs, length)
        o, lse = attention_part(q[b : b + 1], keys, values, scale)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def merge_reference(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact merge of normalized parts by their log-sum-exps."""
    lse = torch.stack(lses)
    top = lse.max(0).values.nan_to_num(neginf=0.0)
    w = torch.exp(lse - top)
    return (w[..., None] * torch.stack(outs)).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]


def paged_prefill_reference(q, k_pool, v_pool, block_tables, query_start, context_lens, first_seq, scale,
                            window=None):
    """Rows of sequences first_seq.. of flat q [T, Hq, D]: causal attention over their cached keys (the
    query at p sees keys p - window < j <= p with a window)."""
    out = torch.zeros_like(q)
    starts, lens = query_start.tolist(), context_lens.tolist()
    for b in range(first_seq, len(lens)):
        lo, hi, length = starts[b], starts[b + 1], lens[b]
        keys = gather_keys(k_pool, block_tables[b], 0, length)
        values = gather_keys(v_pool, block_tables[b], 0, length)
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = k_pos <= q_pos[:, None]
        if window is not None:
            visible &= k_pos > q_pos[:, None] - window
        out[lo:hi] = attention_part(q[lo:hi], keys, values, scale, visible)[0].to(q.dtype)
    return out
