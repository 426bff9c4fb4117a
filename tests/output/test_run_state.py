"""rows_to_do streams exactly the rows a RunState still has to do, unit by unit; UnitWriter commits complete units."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import JobError
from pipeline.output.commit import UnitWriter
from pipeline.output.run_state import RunState
from pipeline.output.signals import GracefulStop
from pipeline.output.sink import ParquetSink
from pipeline.plan.digests import WindowDigests
from pipeline.plan.rows import UnitRows, rows_to_do
from pipeline.plan.units import InputFile, WorkPlan
from pipeline.source.files import ParquetSource
from tests.output.jobs import read_output, write_prompts

FP = {"model": {"path": "m"}}
COLUMNS = ["id", "prompt"]
SCHEMA = pa.schema([("id", pa.int64()), ("sample_index", pa.int32())])


@pytest.fixture
def source(tmp_path) -> ParquetSource:
    # 3 files (7, 0 and 6 rows), read in batches of 4: windows cross files and batches.
    write_prompts(tmp_path / "in" / "a.parquet", [{"id": i, "prompt": f"p{i}"} for i in range(7)])
    write_prompts(tmp_path / "in" / "b.parquet", [], pa.schema([("id", pa.int64()), ("prompt", pa.string())]))
    write_prompts(tmp_path / "in" / "c.parquet", [{"id": 7 + i, "prompt": f"p{7 + i}"} for i in range(6)])
    return ParquetSource(str(tmp_path / "in"))


def checkpoint(source, out, stop=None, **kw) -> RunState:
    plan = WorkPlan(tuple(InputFile(f.name, f.size, f.num_rows) for f in source.files), window_rows=5,
                    rows_per_part=2)
    args = {"num_shards": None, "shard_index": None, "lease_timeout_s": 30,
            "read_input": lambda: ((f.name, b) for f, _, b in source.batches(COLUMNS, 3))}
    return RunState(str(out), plan, FP, stop=stop or GracefulStop(10), **{**args, **kw})


def rows(state: RunState, source: ParquetSource, writer: UnitWriter | None = None):
    """The rows to do, feeding `writer` (a stand-in without one)."""
    digests, unit_rows = ((writer.digests, writer.rows) if writer else
                          (WindowDigests(state.plan, ()), UnitRows(state.plan, state.fixed, state.retry)))
    return rows_to_do(source, state.plan, state.todo, COLUMNS, 4, digests, unit_rows,
                      stopping=lambda: state.stop.stopping)


def streamed(state: RunState, source: ParquetSource) -> list[tuple[str, int, str, int, int]]:
    return [(u.id, pos, file.name, row_index, row["id"]) for u, pos, file, row_index, row in rows(state, source)]


def test_rows_follow_units_and_windows(source, tmp_path):
    cp = checkpoint(source, tmp_path / "out")
    assert cp.start("resume") == "run"
    rows = streamed(cp, source)
    assert [r[4] for r in rows] == list(range(13))
    # windows of 5 rows (the third has 3), units of 2 inside them: 2+2+1 | 2+2+1 | 2+1
    assert [r[0] for r in rows] == ["000000"] * 2 + ["000001"] * 2 + ["000002"] + ["000003"] * 2 + [
        "000004"] * 2 + ["000005"] + ["000006"] * 2 + ["000007"]
    assert rows[7] == ("000004", 0, "c.parquet", 0, 7)  # row positions inside their own file
    cp.close()


def test_committed_units_are_skipped_and_shards_get_their_own(source, tmp_path):
    out = tmp_path / "out"
    cp = checkpoint(source, out)
    cp.start("resume")
    sink = ParquetSink(str(out), pa.schema([("id", pa.int64()), ("sample_index", pa.int32())]), {})
    writer = UnitWriter(cp, sink, samples=2)
    for unit, pos, _, _, row in rows(cp, source, writer):
        if unit.id in ("000001", "000006"):
            for s in (1, 0):  # samples arrive out of order; the part is sorted
                writer.add(unit, pos, {"id": row["id"], "sample_index": s})
    cp.close()
    assert writer.committed_units == 2 and not writer.open
    assert [(r["id"], r["sample_index"]) for r in read_output(str(out))] == [
        (10, 0), (10, 1), (11, 0), (11, 1), (2, 0), (2, 1), (3, 0), (3, 1)]  # sorted by str(id)

    again = checkpoint(source, out)
    again.start("resume")
    assert [r[4] for r in streamed(again, source)] == [0, 1, 4, 5, 6, 7, 8, 9, 12]
    again.close()
    shard = checkpoint(source, out, num_shards=2, shard_index=1)  # units 4..7, 6 committed
    shard.start("resume")
    assert [u.id for u in shard.todo] == ["000004", "000005", "000007"]
    assert [r[4] for r in streamed(shard, source)] == [7, 8, 9, 12]
    shard.close()


def test_rows_stop_when_a_stop_is_requested(source, tmp_path):
    stop = GracefulStop(10)
    cp = checkpoint(source, tmp_path / "out", stop=stop)
    cp.start("resume")
    got = []
    for _, _, _, _, row in rows(cp, source):
        got.append(row["id"])
        if len(got) == 3:
            stop.request_stop("test")
    assert got == [0, 1, 2]
    cp.close()


def test_a_lost_lease_refuses_to_commit(source, tmp_path):
    from pipeline.output.lease import LeaseHeld

    out = tmp_path / "out"
    cp = checkpoint(source, out)
    cp.start("resume")
    writer = UnitWriter(cp, ParquetSink(str(out), pa.schema([("id", pa.int64())]), {}), samples=1)
    cp.lease.lost = "lease taken over by host x"
    unit, pos, _, _, row = next(rows(cp, source, writer))
    writer.add(unit, pos, {"id": row["id"]})
    with pytest.raises(LeaseHeld, match="not committing unit 000000: lease taken over"):
        writer.add(unit, pos + 1, {"id": 1})
    cp.close()


def test_an_input_that_shrinks_after_listing_is_an_error_not_lost_rows(source, tmp_path):
    from pipeline.errors import JobError

    cp = checkpoint(source, tmp_path / "out")
    cp.start("resume")
    write_prompts(tmp_path / "in" / "c.parquet", [{"id": 7, "prompt": "p7"}])  # 6 rows listed, 1 left
    with pytest.raises(JobError, match="the input changed while it was read: 13 rows listed, 8 read"):
        streamed(cp, source)
    cp.close()


def commit(state: RunState, source: ParquetSource, units: tuple[str, ...]) -> None:
    writer = UnitWriter(state, ParquetSink(state.root, pa.schema([("id", pa.int64())]), {}), samples=1)
    for unit, pos, _, _, row in rows(state, source, writer):
        if unit.id in units:
            writer.add(unit, pos, {"id": row["id"]})


def test_a_resume_finds_committed_units_whose_input_rows_changed(source, tmp_path, caplog):
    out = tmp_path / "out"
    cp = checkpoint(source, out)
    cp.start("resume")
    commit(cp, source, ("000001", "000006"))
    cp.close()
    # Row 11 (window 2: rows 10-12, unit 6) gets another prompt of the same size.
    write_prompts(tmp_path / "in" / "c.parquet", [{"id": 7 + i, "prompt": f"q{7 + i}" if i == 4 else f"p{7 + i}"}
                                                 for i in range(6)])
    with pytest.raises(JobError, match=r"^input rows changed since they were committed: unit 000006 "
                                       r"\(c.parquet\); restore the input, or set output.on_input_change=redo"):
        checkpoint(source, out).start("resume")
    assert set(cp.ledger.committed()) == {"000001", "000006"}  # nothing dropped

    redo = checkpoint(source, out, on_input_change="redo")
    assert redo.start("resume") == "run"
    assert [u.id for u in redo.todo] == ["000000", "000002", "000003", "000004", "000005", "000006", "000007"]
    assert set(redo.ledger.committed()) == {"000001"}
    assert "unit 000006 is redone: its input rows in c.parquet changed since it was committed" in caplog.text
    commit(redo, source, ("000006",))
    redo.close()
    again = checkpoint(source, out)
    again.start("resume")  # the new record holds the new rows' digests
    assert "000006" not in [u.id for u in again.todo]
    again.close()


def test_records_without_row_digests_are_not_checked(source, tmp_path):
    out = tmp_path / "out"
    cp = checkpoint(source, out)
    cp.start("resume")
    part = ParquetSink(str(out), pa.schema([("id", pa.int64())]), {}).write_rows("000006", [{"id": 10}, {"id": 11}],
                                                                                  [10, 11])
    cp.ledger.commit("000006", part.name, part.bytes, [10, 11])  # as jobs before row digests wrote them
    cp.close()
    write_prompts(tmp_path / "in" / "c.parquet", [{"id": 7 + i, "prompt": f"q{7 + i}"} for i in range(6)])
    again = checkpoint(source, out)
    assert again.start("resume") == "run" and "000006" not in [u.id for u in again.todo]
    again.close()


def test_unit_rows_keep_committed_rows_and_share_the_rest_in_planned_order():
    plan = WorkPlan((InputFile("a", 1, 5),), window_rows=5, rows_per_part=2)  # units [0, 2), [2, 4), [4, 5)
    units = plan.window_units(0)
    plain = UnitRows(plan, {0: [0, 1]}, {})
    plain.cut(0, [0, 1, 2, 3, 4], units[1:])
    assert plain.rows == {1: [2, 3], 2: [4]}  # the order unit 0 was cut from: the plain cut
    moved = UnitRows(plan, {0: [4, 1]}, {})  # unit 0 was cut from an order that has changed since
    moved.cut(0, [0, 1, 2, 3, 4], units[1:])
    assert moved.rows == {1: [0, 2], 2: [3]}


def test_units_keep_their_rows_when_the_planned_order_changes(source, tmp_path):
    """A row that failed and runs now sorts elsewhere, so the planned order of a resume may differ from the
    one committed units were cut from: every row still lands in exactly one unit."""
    out = tmp_path / "out"

    def run(planner, units=None) -> None:
        cp = checkpoint(source, out)
        cp.start("resume")
        writer = UnitWriter(cp, ParquetSink(str(out), SCHEMA, {}), samples=1)
        for unit, pos, _, _, row in rows_to_do(source, cp.plan, cp.todo, COLUMNS, 4, writer.digests, writer.rows,
                                               planner):
            if units is None or unit.id in units:
                writer.add(unit, pos, {"id": row["id"], "sample_index": 0})
        cp.close()

    run(lambda rows: list(enumerate(rows))[::-1], units=("000000", "000004"))  # ids 4, 3 and 7, 6
    run(lambda rows: list(enumerate(rows)))
    assert sorted(r["id"] for r in read_output(str(out))) == list(range(13))


def test_retry_errors_redoes_the_error_rows_only(source, tmp_path, caplog):
    out = tmp_path / "out"

    def run(result, **kw) -> tuple[RunState, str]:
        """A run whose rows to do come out as `result(id)`."""
        cp = checkpoint(source, out, **kw)
        status = cp.start("resume")
        writer = UnitWriter(cp, ParquetSink(str(out), SCHEMA.append(pa.field("text", pa.string()))
                                                      .append(pa.field("error", pa.string())), {}), samples=1)
        for unit, pos, _, _, row in rows(cp, source, writer):
            writer.add(unit, pos, {"id": row["id"], "sample_index": 0, **result(row["id"])})
        cp.finish()
        cp.close()
        return cp, status

    run(lambda i: {"text": None, "error": "boom"} if i in (3, 11) else {"text": f"t{i}", "error": None})
    before = read_output(str(out))
    with caplog.at_level(logging.INFO):
        cp, status = run(lambda i: {"text": f"again {i}", "error": None}, retry_errors=True)
    assert status == "run" and [u.id for u in cp.todo] == ["000001", "000006"] and cp.todo_rows == 2
    assert "output.retry_errors: 2 error rows found in 8 committed units; 2 are retried" in caplog.text
    after = read_output(str(out))
    assert [r for r in after if r["id"] not in (3, 11)] == [r for r in before if r["id"] not in (3, 11)]
    assert [(r["id"], r["text"]) for r in after if r["id"] in (3, 11)] == [(11, "again 11"), (3, "again 3")]
    assert cp.ledger.is_complete()
    assert run(lambda i: {}, retry_errors=True)[1] == "idle"  # no error rows left


def test_parts_without_input_rows_keep_their_error_rows(source, tmp_path, caplog):
    out = tmp_path / "out"
    cp = checkpoint(source, out)
    cp.start("resume")
    part = out / "part-000006.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 10, "error": "boom"}, {"id": 11, "error": None}]), part)
    cp.ledger.commit("000006", part.name, part.stat().st_size, [10, 11])  # as jobs before input rows wrote it
    cp.close()
    again = checkpoint(source, out, retry_errors=True)
    assert again.start("resume") == "run"
    assert "000006" not in [u.id for u in again.todo] and not again.retry
    assert ("unit 000006: its 1 error rows are not retried: part part-000006.parquet was written before parts "
            "recorded their input rows") in caplog.text
    again.close()
