"""Prefix-aware ordering of prompts.

Sorting token sequences lexicographically visits the prefix tree depth first, so rows that share a
prefix (a system prompt, few-shot examples) become adjacent and each shared prefix can be prefilled
once while its cache blocks are hot. The sort is stable: equal prompts keep their input order, so a
plan is deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def prefix_order(token_seqs: Sequence[Sequence[int]], groups: Sequence[str | None] | None = None) -> list[int]:
    """Indices of `token_seqs` in lexicographic token order (ties in input order). With `groups` (each
    sequence's LoRA adapter, None first), by group first: a prefix is shared only within one adapter."""
    if groups is None:
        return sorted(range(len(token_seqs)), key=lambda i: list(token_seqs[i]))
    return sorted(range(len(token_seqs)),
                  key=lambda i: (groups[i] is not None, groups[i] or "", list(token_seqs[i])))


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


class PrefixTreeCounter:
    """Distinct prefix-tree nodes of the sequences added so far, kept up to date one sequence at a time.

    Why: the job reports the prefill lower bound while rows stream into the engine, in whatever order they
    arrive. In sorted order each sequence adds len - lcp with its sorted neighbours; inserting `s` between
    `p` and `q` adds len(s) - max(lcp(p, s), lcp(s, q)) nodes (lcp(p, q) is the smaller of the two).
    """

    def __init__(self) -> None:
        self.sorted: list[list[int]] = []
        self.total = 0

    def add(self, seq: Sequence[int]) -> int:
        """Insert one sequence; returns the nodes it added."""
        s = list(seq)
        i = bisect.bisect_left(self.sorted, s)
        shared = max(common_prefix_len(self.sorted[i - 1], s) if i else 0,
                     common_prefix_len(s, self.sorted[i]) if i < len(self.sorted) else 0)
        self.sorted.insert(i, s)
        self.total += len(s) - shared
        return len(s) - shared
