"""The rows a run still has to do, read window by window in planned order and cut into its units."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipeline.errors import JobError
from pipeline.plan.digests import WindowDigests
from pipeline.plan.units import Unit, WorkPlan, group_units_by_window
from pipeline.source.files import ParquetSource, SourceFile
from pipeline.source.files import batch_rows as rows_of


def rows_to_do(source: ParquetSource, plan: WorkPlan, todo: list[Unit], columns: list[str], batch_rows: int,
               digests: WindowDigests, planner: Callable[[list[dict]], list[tuple[int, Any]]] | None = None,
               stopping: Callable[[], bool] = lambda: False,
               ) -> Iterator[tuple[Unit, int, SourceFile, int, Any]]:
    """(unit, position in unit, input file, row index in file, row) for every row still to do, in
    unit order. Windows with nothing to do are skipped without decoding; one window is held at a time.
    Every batch read goes to `digests` (`UnitWriter.digests`: the todo windows' digests, which their units
    record), so a window's digests are known before its first row is yielded.
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
        for i, row in enumerate(rows_of(batch)):
            g = lo + i
            if g // wr not in by_window:
                continue
            window.append((file, start + i, row))
            w = g // wr
            if len(window) == plan.window_size(w):
                if planner is not None:
                    window = [(*window[i][:2], item) for i, item in planner([r for _, _, r in window])]
                for unit in by_window[w]:
                    for pos in range(unit.start, unit.stop):
                        if stopping():
                            return
                        yield (unit, pos - unit.start, *window[pos])
                window = []
                if w == last:
                    return
    raise JobError(f"the input changed while it was read: {plan.total_rows} rows listed, {offset} read")
