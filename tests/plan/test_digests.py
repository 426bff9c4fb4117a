"""Row digests depend on the rows' values only, and name the units and files whose rows changed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.plan.digests import WindowDigests, changed_units, describe_changed, rows_digest
from pipeline.plan.units import InputFile, WorkPlan
from pipeline.source.files import ParquetSource, footer_digest

NO_STATS = {"compression": "none", "use_dictionary": False, "write_statistics": False}


def rows(letter: str = "a", n: int = 24) -> pa.Table:
    """Prompts of equal length for any letter; every third score and every fifth message list is null."""
    return pa.Table.from_pylist([
        {"id": i, "prompt": f"Write one line about item {letter}{i:02d}.", "score": None if i % 3 else 1.5,
         "messages": [{"role": "user", "content": f"hi {i}"}] if i % 5 else None} for i in range(n)])


def read(path, batch_rows: int) -> list[pa.RecordBatch]:
    return list(pq.ParquetFile(path).iter_batches(batch_size=batch_rows))


def test_digest_depends_on_values_not_on_batches_or_row_groups(tmp_path):
    pq.write_table(rows(), tmp_path / "one.parquet", **NO_STATS)
    pq.write_table(rows(), tmp_path / "groups.parquet", row_group_size=5)
    digests = {rows_digest(read(tmp_path / name, n)) for name in ("one.parquet", "groups.parquet")
               for n in (1, 5, 7, 24)}
    assert len(digests) == 1


def test_digest_ignores_the_bytes_under_nulls_and_slice_offsets():
    def scores(under_null: float) -> pa.Array:
        valid = pa.array([True, False, True]).buffers()[1]
        return pa.Array.from_buffers(pa.float64(), 3, [valid, pa.array([1.0, under_null, 2.0]).buffers()[1]])

    a, b = scores(0.0), scores(1.5)
    assert a.equals(b) and a.buffers()[1] != b.buffers()[1]
    sliced = pa.array([9.0, 1.0, None, 2.0]).slice(1)
    assert len({rows_digest([pa.record_batch([x], ["score"])]) for x in (a, b, sliced)}) == 1


def test_an_edit_that_keeps_the_footer_changes_the_digest(tmp_path):
    pq.write_table(rows("a"), tmp_path / "a.parquet", **NO_STATS)
    edited = rows("a").to_pylist()
    edited[5]["prompt"] = edited[5]["prompt"].replace("a05", "b05")
    pq.write_table(pa.Table.from_pylist(edited), tmp_path / "b.parquet", **NO_STATS)
    with open(tmp_path / "a.parquet", "rb") as a, open(tmp_path / "b.parquet", "rb") as b:
        assert footer_digest(a) == footer_digest(b)  # what the fingerprint compares
    assert rows_digest(read(tmp_path / "a.parquet", 7)) != rows_digest(read(tmp_path / "b.parquet", 7))


def source_of(tmp_path, edit: int | None = None) -> ParquetSource:
    """Two files of 7 and 6 rows; `edit`: a row of the second file whose prompt changes, keeping its size."""
    table = rows(n=13)
    (tmp_path / "in").mkdir(exist_ok=True)
    pq.write_table(table.slice(0, 7), tmp_path / "in" / "a.parquet", **NO_STATS)
    second = table.slice(7).to_pylist()
    if edit is not None:
        second[edit]["prompt"] = second[edit]["prompt"].upper()
    pq.write_table(pa.Table.from_pylist(second, schema=table.schema), tmp_path / "in" / "c.parquet", **NO_STATS)
    return ParquetSource(str(tmp_path / "in"))


def batches(source: ParquetSource, batch_rows: int = 4):
    return ((f.name, b) for f, _, b in source.batches(["id", "prompt"], batch_rows))


def test_windows_are_digested_per_file_whatever_the_batches(tmp_path):
    source = source_of(tmp_path)
    plan = WorkPlan(tuple(InputFile(f.name, f.size, f.num_rows) for f in source.files), 5, 2)
    found = []
    for batch_rows in (1, 4, 100):
        digests = WindowDigests(plan, {1, 2})
        for name, batch in batches(source, batch_rows):
            digests.add(name, batch)
        found.append(digests.done)
    assert found[0] == found[1] == found[2]
    # rows 5-9 are a.parquet's last two and c.parquet's first three; rows 10-12 are c.parquet's
    assert sorted(found[0]) == [1, 2]
    assert sorted(found[0][1]) == ["a.parquet", "c.parquet"] and sorted(found[0][2]) == ["c.parquet"]


def test_changed_units_name_the_units_of_changed_windows_and_their_files(tmp_path):
    source = source_of(tmp_path)
    plan = WorkPlan(tuple(InputFile(f.name, f.size, f.num_rows) for f in source.files), 5, 2)
    units = list(plan.units())  # windows of 5, 5 and 3 rows; units 0-2, 3-5, 6-7
    digests = WindowDigests(plan, {0, 1, 2})
    for name, batch in batches(source):
        digests.add(name, batch)
    recorded = {u: digests.done[u.window] for u in units}
    assert changed_units(batches(source), plan, recorded) == {}

    edited = source_of(tmp_path, edit=1)  # row 8: window 1
    assert changed_units(batches(edited), plan, recorded) == {"000003": ["c.parquet"], "000004": ["c.parquet"],
                                                              "000005": ["c.parquet"]}
    assert describe_changed({"000004": ["c.parquet"], "000003": ["c.parquet"]}) == "units 000003, 000004 (c.parquet)"
    shorter = ((name, b.slice(0, 1)) for name, b in batches(source, 100))  # one row of each file left
    assert set(changed_units(shorter, plan, recorded)) == {u.id for u in units}
