"""Prefix-aware ordering of prompts.

Sorting token sequences lexicographically visits the prefix tree depth first, so rows that share a
prefix (a system prompt, few-shot examples) become adjacent and each shared prefix can be prefilled
once while its cache blocks are hot. The sort is stable: equal prompts keep their input order, so a
plan is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


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


def ordered_windows(
    items: Iterable[T], tokens: Callable[[T], Sequence[int]], window_rows: int, sort: bool = True
) -> Iterator[list[T]]:
    """Cut a stream into windows of at most `window_rows` items, each in prefix order when `sort`.

    Memory stays bounded by one window whatever the input size; a window is the unit the prefix
    lower bound and the ordering are computed over.
    """
    if window_rows < 1:
        raise ValueError(f"plan.window_rows must be >= 1, got {window_rows}")
    window: list[T] = []
    for item in items:
        window.append(item)
        if len(window) == window_rows:
            yield _ordered(window, tokens, sort)
            window = []
    if window:
        yield _ordered(window, tokens, sort)


def _ordered(window: list[T], tokens: Callable[[T], Sequence[int]], sort: bool) -> list[T]:
    if not sort:
        return window
    return [window[i] for i in prefix_order([tokens(x) for x in window])]
