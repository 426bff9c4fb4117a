"""The planned order of one window of input rows, each row carrying its prepared prompt.

Why: `rows_to_do` (pipeline/plan/rows.py) cuts the input into windows of `plan.window_rows` rows and cuts each window's
*planned* order into units; this module gives that order. A window is tokenized here once and each row's
prepared prompt travels with it to the engine, so no row is tokenized twice and memory stays bounded by one
window. With `plan.prefix_sort` the order is lexicographic by token ids (the depth-first order of the
window's prefix tree, ties in input order), so rows sharing a system prompt reach the engine together and
its cache blocks are hot while they run; rows with a LoRA adapter come after the base model's, grouped by
adapter (a prefix is shared only under one adapter). Error rows (no tokens) sort first; the order depends
only on the rows' tokens and adapters, so a restart plans every window identically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.plan.prefix import PrefixTreeCounter, prefix_order
from pipeline.source.prompts import Prepared


@dataclass(frozen=True)
class PlannedRow:
    row: Mapping[str, Any]
    prepared: Prepared


class WindowPlanner:
    """`rows_to_do`'s planner: a window's rows -> [(index in the window, PlannedRow)] in planned order."""

    def __init__(self, prepare: Callable[[Mapping[str, Any]], Prepared], prefix_sort: bool = True) -> None:
        self.prepare = prepare
        self.prefix_sort = prefix_sort
        self.windows = 0  # windows planned so far

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, PlannedRow]]:
        prepared = [self.prepare(row) for row in rows]
        if self.prefix_sort:  # by LoRA adapter, then tokens: error rows (no tokens, no adapter) first
            order = prefix_order([p.token_ids or () for p in prepared], [p.adapter for p in prepared])
        else:
            order = list(range(len(rows)))
        self.windows += 1
        return [(i, PlannedRow(rows[i], prepared[i])) for i in order]


class PrefillLowerBound:
    """The least prefill any order could do for the prompts sent to the engine: the distinct prefix-tree
    nodes of each window's prompts, summed over windows (the cache may still carry a prefix across windows,
    so a run can beat it there). Each LoRA adapter has a tree of its own: no prefix is shared across them."""

    def __init__(self) -> None:
        self.window: int | None = None
        self.trees: dict[str | None, PrefixTreeCounter] = {}  # the current window's, per adapter
        self.finished = 0  # bound of the windows before the current one

    def add(self, window: int, token_ids: Sequence[int], adapter: str | None = None) -> None:
        if window != self.window:
            self.finished += self._window_total()
            self.window, self.trees = window, {}
        self.trees.setdefault(adapter, PrefixTreeCounter()).add(token_ids)

    def _window_total(self) -> int:
        return sum(tree.total for tree in self.trees.values())

    @property
    def total(self) -> int:
        return self.finished + self._window_total()
