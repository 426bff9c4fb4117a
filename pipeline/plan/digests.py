"""Digests of the input rows each unit was planned from, so a resume and `verify` notice rows that changed.

Why: the Parquet footer (the fingerprint's `input_content`) misses an edit that keeps every column chunk's
size and statistics, and any edit of a file written without statistics. So each committed unit records the
sha256 of its window's rows, per input file: the whole window, because a unit is cut from the window's
planned order and the prefix sort can move an edited row into another unit of the window.

The rows are hashed in a form that depends only on their values: a file's rows of one window (the columns
the job reads), combined into one chunk and encoded as plain, uncompressed Parquet, footer left out (it
names the writer's version). Parquet stores nulls as levels, never the bytes Arrow leaves under a null
slot, so `input.batch_rows`, the file's row groups and Arrow's memory layout do not change a digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.plan.units import Unit, WorkPlan

# Every writer setting that shapes the bytes, pinned, so a pyarrow with other defaults writes the same ones.
_CANONICAL = {"version": "2.6", "data_page_version": "1.0", "compression": "none", "use_dictionary": False,
              "write_statistics": False, "data_page_size": 1 << 20, "write_batch_size": 1024,
              "max_rows_per_page": 20_000}
_LISTED = 8  # units or files named in one message


def rows_digest(batches: Sequence[pa.RecordBatch]) -> str:
    """sha256 of these rows' values, whatever their chunking and memory layout (the module's why)."""
    table = pa.Table.from_batches(batches).combine_chunks()
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=max(table.num_rows, 1), **_CANONICAL)
    data = sink.getvalue()
    footer = int.from_bytes(data.slice(data.size - 8, 4).to_pybytes(), "little")
    return hashlib.sha256(data.slice(4, data.size - 12 - footer)).hexdigest()  # between PAR1 and the footer


class WindowDigests:
    """The digests of chosen windows (window -> input file name -> sha256 of that file's rows in the window),
    fed with every batch of the input in listing order; a window's entry appears once its last row is fed."""

    def __init__(self, plan: WorkPlan, windows: Collection[int]) -> None:
        self.plan = plan
        self.windows = windows
        self.done: dict[int, dict[str, str]] = {}
        self._open: dict[int, dict[str, list[pa.RecordBatch]]] = {}
        self._offset = 0  # index of the next row in the whole input

    def add(self, file: str, batch: pa.RecordBatch) -> None:
        """Feed the input's next batch, read from input file `file`."""
        lo, hi = self._offset, self._offset + batch.num_rows
        self._offset = hi
        wr = self.plan.window_rows
        for w in range(lo // wr, -(-hi // wr)):
            if w not in self.windows:
                continue
            start, stop = w * wr, w * wr + self.plan.window_size(w)
            rows = batch.slice(max(start, lo) - lo, min(stop, hi) - max(start, lo))
            self._open.setdefault(w, {}).setdefault(file, []).append(rows)
            if hi >= stop:
                self.done[w] = {name: rows_digest(part) for name, part in self._open.pop(w).items()}


def changed_units(batches: Iterable[tuple[str, pa.RecordBatch]], plan: WorkPlan,
                  recorded: Mapping[Unit, Mapping[str, str]]) -> dict[str, list[str]]:
    """Units whose recorded digests differ from the input's rows now (unit id -> the files that differ).

    `batches`: (file name, batch) of the whole input in listing order; reading stops after the last window
    of a recorded unit. A window the input no longer reaches counts as changed in all its files."""
    if not recorded:
        return {}
    digests = WindowDigests(plan, {u.window for u in recorded})
    last = max(u.window for u in recorded)
    for name, batch in batches:
        digests.add(name, batch)
        if last in digests.done:
            break
    changed = {}
    for unit, then in recorded.items():
        now = digests.done.get(unit.window, {})
        files = sorted(name for name in then.keys() | now.keys() if then.get(name) != now.get(name))
        if files:
            changed[unit.id] = files
    return changed


def describe_changed(changed: Mapping[str, Sequence[str]]) -> str:
    """`units 000000, 000001 (in.parquet)`: the changed units and the input files their rows changed in."""
    units = sorted(changed)
    files = sorted({name for names in changed.values() for name in names})

    def listed(items: list[str]) -> str:
        more = f" and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
        return ", ".join(items[:_LISTED]) + more

    return f"unit{'s' if len(units) > 1 else ''} {listed(units)} ({listed(files)})"
