"""Prefix-aware ordering of prompts.

Sorting token sequences lexicographically visits the prefix tree depth first, so rows that share a
prefix (a system prompt, few-shot examples) become adjacent and each shared prefix can be prefilled
once while its cache blocks are hot. The sort is stable: equal prompts keep their input order, so a
plan is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence


def prefix_order(token_seqs: Sequence[Sequence[int]]) -> list[int]:
    """Indices of `token_seqs` in lexicographic token order (ties in input order)."""
    return sorted(range(len(token_seqs)), key=lambda i: list(token_seqs[i]))


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def unique_prefix_tokens(token_seqs: Sequence[Sequence[int]]) -> int:
    """Distinct nodes of the prefix tree of the sequences: the least prefill any order can do
    (every distinct prefix must be computed at least once)."""
    ordered = sorted(list(s) for s in token_seqs)
    total, prev = 0, []
    for seq in ordered:
        total += len(seq) - common_prefix_len(prev, seq)
        prev = seq
    return total
