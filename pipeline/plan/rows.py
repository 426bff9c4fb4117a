"""The rows a run still has to do, read window by window in planned order and cut into its units."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from pipeline.errors import JobError
from pipeline.plan.digests import WindowDigests
from pipeline.plan.units import Unit, WorkPlan, group_units_by_window
from pipeline.source.files import SourceFile
from pipeline.source.formats import Source


class UnitRows:
    """The input rows of each unit to do (each one's index in the whole input, in part order), and which of
    them to run.

    Why: a unit is cut from its window's planned order, which depends on the rows' prompts as this run
    prepares them: a row that failed (no prompt; error rows sort first) and now runs sorts elsewhere. So a
    committed unit keeps the rows its part records (`fixed`), and the window's other units share the rest in
    the planned order: every row is in exactly one unit, whatever changed since. Without a change the cut
    is the plain one. `retry`: the positions of a unit's rows to run again (`output.retry_errors`); the
    others stay as its part has them. `UnitWriter` takes each unit's rows when it commits the unit.
    """

    def __init__(self, plan: WorkPlan, fixed: Mapping[int, list[int]], retry: Mapping[int, list[int]]) -> None:
        self.plan = plan
        self.fixed = fixed  # unit index -> input rows, of committed units sharing a window with work to do
        self.retry = retry
        self.rows: dict[int, list[int]] = {}  # unit index -> input rows, of the units to do cut so far

    def cut(self, window: int, order: list[int], todo: list[Unit]) -> None:
        """Record the rows of `window`'s units to do, given its planned order (input row indexes)."""
        units = self.plan.window_units(window)
        taken = {i for u in units for i in self.fixed.get(u.index, ())}
        free = iter([i for i in order if i not in taken])
        rows = {u.index: self.fixed.get(u.index) or list(itertools.islice(free, u.num_rows)) for u in units}
        self.rows.update((u.index, rows[u.index]) for u in todo)

    def positions(self, unit: Unit) -> Iterable[int]:
        """The positions of `unit`'s rows to run: all, or only those to retry."""
        return self.retry.get(unit.index, range(unit.num_rows))


def rows_to_do(source: Source, plan: WorkPlan, todo: list[Unit], columns: list[str], batch_rows: int,
               digests: WindowDigests, unit_rows: UnitRows,
               planner: Callable[[list[dict]], list[tuple[int, Any]]] | None = None,
               stopping: Callable[[], bool] = lambda: False,
               ) -> Iterator[tuple[Unit, int, SourceFile, int, Any]]:
    """(unit, position in unit, input file, row index in file, row) for every row still to do, in
    unit order. Windows with nothing to do are skipped without decoding; one window is held at a time.
    Every batch read goes to `digests` (`UnitWriter.digests`: the todo windows' digests, which their units
    record), so a window's digests are known before its first row is yielded. `unit_rows` says which rows
    each unit holds and which of them to run (`UnitWriter.rows`).
    Stops early once `stopping()` is true (the unfinished unit is redone on resume).

    `planner` (see pipeline/plan/window.py) gets each whole window's rows and returns its planned order
    as (index in the window, item); units are cut from that order and the item is yielded as the row.
    It must be deterministic so that a restart cuts the same units. Without it the order is the input's."""
    by_window = group_units_by_window(todo)
    if not by_window:
        return
    last = max(by_window)
    wr = plan.window_rows
    window: list[tuple[SourceFile, int, dict]] = []
    offset = 0  # global index of the batch's first row
    for file, start, batch in source.batches(columns, batch_rows):
        lo, hi = offset, offset + batch.num_rows
        offset = hi
        digests.add(file.name, batch)
        if not any(w in by_window for w in range(lo // wr, (hi - 1) // wr + 1)):
            continue
        for i, row in enumerate(source.rows(file, start, batch)):
            g = lo + i
            if g // wr not in by_window:
                continue
            window.append((file, start + i, row))
            w = g // wr
            if len(window) == plan.window_size(w):
                planned = planner([r for _, _, r in window]) if planner is not None else list(
                    enumerate(r for _, _, r in window))
                unit_rows.cut(w, [w * wr + j for j, _ in planned], by_window[w])
                items = dict(planned)
                for unit in by_window[w]:
                    rows = unit_rows.rows[unit.index]
                    for pos in unit_rows.positions(unit):
                        if stopping():
                            return
                        k = rows[pos] - w * wr
                        yield unit, pos, window[k][0], window[k][1], items[k]
                window = []
                if w == last:
                    return
    raise JobError(f"the input changed while it was read: {plan.total_rows} rows listed, {offset} read")
