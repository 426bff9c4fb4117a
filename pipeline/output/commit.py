"""Committing units: collect each unit's output rows, write its part and ledger record when it is whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.output.run_state import RunState
from pipeline.output.sink import Sink
from pipeline.plan.digests import WindowDigests
from pipeline.plan.rows import UnitRows
from pipeline.plan.units import Unit


@dataclass
class _Open:
    unit: Unit
    expected: int
    rows: list[tuple[int, int, dict]] = field(default_factory=list)  # (position, sample_index, row)


class UnitWriter:
    """Collects each unit's output rows and commits the unit when its last row arrives.

    Rows are sorted by (position in the unit's planned order, sample index) before writing, so a part's content does not depend
    on the order in which the engine finished its rows. `digests` and `rows` are fed by `rows_to_do` as it
    reads the windows still to do; a unit's window is read whole before its rows reach the engine, so its
    digests and input rows are there to record when the unit commits. A unit whose error rows are redone
    (`RunState.retry`) starts with the other rows of its part, as they are.
    """

    def __init__(self, state: RunState, sink: Sink, samples: int) -> None:
        self.state = state
        self.sink = sink
        self.samples = samples
        self.digests = WindowDigests(state.plan, {u.window for u in state.todo})
        self.rows = UnitRows(state.plan, state.fixed, state.retry)
        self.open: dict[int, _Open] = {}
        self.committed_units = 0
        self.rows_written = 0

    def add(self, unit: Unit, position: int, row: dict) -> None:
        slot = self.open.get(unit.index)
        if slot is None:
            slot = self.open[unit.index] = self._open_unit(unit)
        slot.rows.append((position, row.get("sample_index", 0), row))
        if len(slot.rows) == slot.expected:
            del self.open[unit.index]
            self._commit(slot)

    def _open_unit(self, unit: Unit) -> _Open:
        slot = _Open(unit, unit.num_rows * self.samples)
        redo = self.state.retry.get(unit.index)
        if redo is not None:  # keep the rows that did not fail, read from the part again
            rows = self.state.ledger.part_rows(self.sink.part_name(unit.id))
            positions = set(redo)
            slot.rows = [(j // self.samples, row.get("sample_index", 0), row) for j, row in enumerate(rows)
                         if j // self.samples not in positions]
        return slot

    def _commit(self, slot: _Open) -> None:
        """Write the unit's part, then its ledger record, through the lease's fence (`Lease.commit`): a job
        whose lease another job took over stops here (LeaseHeld) and writes nothing of the unit."""
        slot.rows.sort(key=lambda r: (r[0], r[1]))
        rows = [r for _, _, r in slot.rows]
        with self.state.stop.critical(), self.state.lease.commit(f"unit {slot.unit.id}") as put:
            part = self.sink.write_rows(slot.unit.id, rows, self.rows.rows.pop(slot.unit.index), put)
            self.state.ledger.commit(slot.unit.id, part.name, part.bytes, part.ids,
                                     self.digests.done[slot.unit.window], put, part.input_rows)
        self.committed_units += 1
        self.rows_written += part.rows
