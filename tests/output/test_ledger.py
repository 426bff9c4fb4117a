"""Commit protocol: a part without its ledger record is never a result; verify catches damaged parts."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.ledger import Ledger, ids_checksum, part_name
from pipeline.output.sink import ParquetSink

SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


def commit(ledger: Ledger, unit: str, ids: list[int]):
    """What the job does: the sink writes the part whole, then the ledger records it."""
    part = ParquetSink(f"{ledger.fs.unstrip_protocol(ledger.root)}", SCHEMA, {}).write_rows(
        unit, [{"id": i, "text": f"t{i}"} for i in ids], list(range(len(ids))))
    return ledger.commit(unit, part.name, part.bytes, ids)


def test_commit_writes_part_then_record(output_url: str) -> None:
    ledger = Ledger(*fsspec.core.url_to_fs(output_url))
    rec = commit(ledger, "000003", [5, 6, 7])
    assert (rec.unit, rec.part, rec.rows) == ("000003", "part-000003.parquet", 3)
    with ledger.fs.open(ledger.path(rec.part), "rb") as f:
        assert pq.read_table(f).column("text").to_pylist() == ["t5", "t6", "t7"]
    assert ledger.fs.size(ledger.path(rec.part)) == rec.bytes
    assert ledger.committed() == {"000003": rec}
    stored = json.loads(ledger.fs.cat_file(ledger.record_path("000003")))
    assert stored["ids_sha256"] == rec.ids_sha256
    report = ledger.verify({"000003": 3})
    assert report.ok and report.rows == 3 and report.committed_units == 1


def test_ids_checksum_matches_an_independent_digest_and_ignores_order() -> None:
    ids = ["b", "a", "c", "a"]
    expected = hashlib.sha256(b'"a"\n"a"\n"b"\n"c"').hexdigest()
    assert ids_checksum(ids) == expected
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    assert ids_checksum(shuffled) == expected
    assert ids_checksum(["a", "b", "c"]) != expected  # a lost duplicate changes it
    assert ids_checksum([1, 2]) != ids_checksum(["1", "2"])  # types matter


def test_recommit_overwrites_and_uncommitted_part_is_not_a_result(output_url: str) -> None:
    ledger = Ledger(*fsspec.core.url_to_fs(output_url))
    ledger.fs.makedirs(ledger.root, exist_ok=True)
    ledger.fs.pipe_file(ledger.path(part_name("000001")), b"garbage from a killed attempt")
    assert ledger.committed() == {}
    report = ledger.verify({"000001": 2})
    assert not report.ok and any("not committed" in e for e in report.errors)
    assert any("part-000001.parquet has no ledger record" in n for n in report.notes)
    commit(ledger, "000001", [1, 2])
    assert ledger.verify({"000001": 2}).ok


@pytest.mark.parametrize(
    "damage,message",
    [
        ("delete", "is missing"),
        ("truncate", "bytes, ledger says"),
        ("swap", "do not match the ledger checksum"),
        ("corrupt", "unreadable"),
    ],
)
def test_verify_reports_damaged_parts(output_url: str, damage: str, message: str) -> None:
    ledger = Ledger(*fsspec.core.url_to_fs(output_url))
    commit(ledger, "000000", [1, 2, 3])
    commit(ledger, "000001", [4, 5, 6])
    path = ledger.path(part_name("000000"))
    data = ledger.fs.cat_file(path)
    if damage == "delete":
        ledger.fs.rm(path)
    elif damage == "truncate":
        ledger.fs.pipe_file(path, data[: len(data) // 2])
    elif damage == "swap":  # same size, different ids: another unit's content under this name
        other = ledger.fs.cat_file(ledger.path(part_name("000001")))
        assert len(other) == len(data)
        ledger.fs.pipe_file(path, other)
    else:
        ledger.fs.pipe_file(path, b"\0" * len(data))
    report = ledger.verify({"000000": 3, "000001": 3})
    assert [e for e in report.errors if message in e], report.errors
    assert all("000001" not in e for e in report.errors)  # the healthy unit passes


def test_verify_flags_units_outside_the_plan_and_unreadable_records(output_url: str) -> None:
    ledger = Ledger(*fsspec.core.url_to_fs(output_url))
    commit(ledger, "000000", [1])
    commit(ledger, "000009", [2])
    assert any("outside the plan" in e for e in ledger.verify({"000000": 1}).errors)
    assert any("wrong row count: 000000 (1 rows, planned 2)" in e for e in ledger.verify({"000000": 2}).errors)
    ledger.fs.pipe_file(ledger.record_path("000005"), b"{not json")
    ledger.fs.pipe_file(ledger.record_path("000006"), b"")  # truncated to nothing
    assert set(ledger.committed()) == {"000000", "000009"}  # an unreadable record commits nothing
    errors = ledger.verify({"000000": 1, "000009": 1}).errors
    assert len(errors) == 2 and all(e.startswith("unreadable ledger record ") for e in errors)
    assert "000005.json" in errors[0] and "000006.json" in errors[1]


def test_success_only_when_every_unit_is_committed(output_url: str) -> None:
    ledger = Ledger(*fsspec.core.url_to_fs(output_url))
    commit(ledger, "000000", [1])
    assert not ledger.mark_success(["000000", "000001"]) and not ledger.is_complete()
    commit(ledger, "000001", [2])
    assert ledger.mark_success(["000000", "000001"]) and ledger.is_complete()


def _commit_with_fault(root: str, point: str) -> None:
    os.environ["PIPELINE_FAULT"] = point
    commit(Ledger(fsspec.filesystem("file"), root), "000002", [1, 2, 3])


@pytest.mark.parametrize(
    "point,part_visible,committed",
    [
        ("part.before_write:1", False, False),
        ("part.mid_write:1", False, False),
        ("part.after_write:1", True, False),
        ("ledger.before_write:1", True, False),
        ("ledger.mid_write:1", True, False),
        ("ledger.after_write:1", True, True),
    ],
)
def test_sigkill_at_each_commit_step_leaves_a_consistent_ledger(tmp_path, point, part_visible, committed) -> None:
    root = str(tmp_path / "out")
    proc = multiprocessing.get_context("fork").Process(target=_commit_with_fault, args=(root, point))
    proc.start()
    proc.join(30)
    assert proc.exitcode == -9  # really killed at that point
    ledger = Ledger(fsspec.filesystem("file"), root)
    assert os.path.exists(ledger.path(part_name("000002"))) == part_visible
    assert ("000002" in ledger.committed()) == committed
    if part_visible:  # whatever is visible under the final name is whole
        assert pq.read_table(ledger.path(part_name("000002"))).num_rows == 3
    def temps() -> list[str]:
        dirs = (root, ledger.path("_progress"))
        return [n for d in dirs if os.path.isdir(d) for n in os.listdir(d) if ".tmp-" in n]

    assert bool(temps()) == ("mid_write" in point)  # a half-written temp file, never the final name
    ledger.remove_leftovers(["000007"])  # another unit's cleanup leaves ours alone
    assert bool(temps()) == ("mid_write" in point)
    ledger.remove_leftovers(["000002"])
    assert not temps()
    commit(ledger, "000002", [1, 2, 3])  # the redo commits normally
    assert ledger.verify({"000002": 3}).ok
