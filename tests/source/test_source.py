"""Input listing, schema checks and streaming reads, on local files and fsspec's memory filesystem."""

from __future__ import annotations

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import JobError
from pipeline.source.files import ColumnSpec, ParquetSource

TEXT = ColumnSpec("prompt", "input.prompt_column", pa.types.is_string, "string")


def write(path, **columns) -> None:
    with fsspec.open(str(path), "wb") as f:
        pq.write_table(pa.table(columns), f)


@pytest.fixture
def shards(tmp_path):
    """Three shards written out of name order, plus files a listing must skip."""
    for name, ids in (("b.parquet", [3, 4]), ("a.parquet", [0, 1, 2]), ("sub/c.parquet", [5])):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        write(tmp_path / name, id=ids, prompt=[f"p{i}" for i in ids], extra=[0.5] * len(ids))
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "notes.txt").write_text("not parquet")
    return tmp_path


def ids(source, batch_rows=100):
    return [i for _, _, b in source.batches(["id"], batch_rows) for i in b.column("id").to_pylist()]


def test_directory_lists_parquet_files_in_stable_order(shards):
    source = ParquetSource(str(shards))
    assert [s.name for s in source.files] == ["a.parquet", "b.parquet", "sub/c.parquet"]
    assert source.total_rows == 6  # from the footers alone
    assert ids(source) == [0, 1, 2, 3, 4, 5]


def test_glob_and_list_inputs(shards):
    assert [s.name for s in ParquetSource(f"{shards}/*.parquet").files] == ["a.parquet", "b.parquet"]
    both = ParquetSource([str(shards / "b.parquet"), str(shards / "sub"), str(shards / "b.parquet")])
    assert ids(both) == [3, 4, 5]  # listed once, sorted


def test_batches_are_bounded_and_carry_their_row_offsets(shards):
    seen = [(shard.name, start, batch.num_rows, batch.schema.names)
            for shard, start, batch in ParquetSource(str(shards)).batches(["id", "prompt"], batch_rows=2)]
    assert seen == [
        ("a.parquet", 0, 2, ["id", "prompt"]), ("a.parquet", 2, 1, ["id", "prompt"]),
        ("b.parquet", 0, 2, ["id", "prompt"]), ("sub/c.parquet", 0, 1, ["id", "prompt"]),
    ]


@pytest.mark.parametrize("path, words", [
    ("missing/*.parquet", "matches no files"),
    ("missing.parquet", "no such file or directory"),
    ("empty", "directory with no .parquet files"),
])
def test_nothing_to_read_is_a_clear_error(tmp_path, path, words):
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match=words):
        ParquetSource(str(tmp_path / path))


@pytest.mark.parametrize("content", [b"this is not parquet", b"PAR1" + b"\0" * 64])
def test_corrupt_files_name_the_file(tmp_path, content):
    write(tmp_path / "good.parquet", prompt=["x"])
    (tmp_path / "zbad.parquet").write_bytes(content)
    with pytest.raises(JobError, match="cannot read Parquet file zbad.parquet"):
        ParquetSource(str(tmp_path))


def test_truncated_data_pages_fail_while_reading(tmp_path):
    """A file whose footer is intact but whose data is damaged fails with the file named, not a traceback."""
    write(tmp_path / "a.parquet", prompt=[f"row {i} " * 50 for i in range(2000)])
    data = bytearray((tmp_path / "a.parquet").read_bytes())
    data[8:len(data) // 2] = bytes(len(data) // 2 - 8)  # zero the first half of the column chunk
    (tmp_path / "a.parquet").write_bytes(bytes(data))
    source = ParquetSource(str(tmp_path))
    with pytest.raises(JobError, match="cannot read Parquet file a.parquet"):
        list(source.batches(["prompt"], 100))


def test_missing_column_lists_the_available_ones(shards):
    spec = ColumnSpec("text", "input.prompt_column", pa.types.is_string, "string")
    with pytest.raises(JobError) as e:
        ParquetSource(str(shards)).check_columns([spec])
    assert str(e.value) == ("a.parquet: no column 'text' (set by input.prompt_column); "
                            "available columns: id, prompt, extra")


def test_wrong_column_type(tmp_path):
    write(tmp_path / "a.parquet", prompt=[1, 2])
    with pytest.raises(JobError, match=r"column 'prompt' \(input.prompt_column\) has type int64, expected string"):
        ParquetSource(str(tmp_path)).check_columns([TEXT])


def test_types_must_agree_across_files_but_all_null_files_fit(tmp_path):
    write(tmp_path / "a.parquet", prompt=pa.array([None, None], pa.null()), n=[1, 2])
    write(tmp_path / "b.parquet", prompt=["x", "y"], n=[1.5, 2.5])
    write(tmp_path / "c.parquet", prompt=["z"], n=[3])
    source = ParquetSource(str(tmp_path))
    assert source.check_columns([TEXT]) == {"prompt": pa.string()}
    any_type = ColumnSpec("n", "input.passthrough_columns", lambda t: True, "any")
    with pytest.raises(JobError, match="b.parquet: column 'n' has type double but earlier files have int64"):
        source.check_columns([any_type])


def test_optional_columns_may_be_absent(shards):
    spec = ColumnSpec("seed", "input.sampling_columns", pa.types.is_integer, "an integer", required=False)
    assert ParquetSource(str(shards)).check_columns([TEXT, spec]) == {"prompt": pa.string()}


def test_memory_filesystem():
    fs = fsspec.filesystem("memory")
    for name, rows in (("x/2.parquet", [2]), ("x/1.parquet", [0, 1])):
        write(f"memory://{name}", id=rows, prompt=["p"] * len(rows))
    try:
        source = ParquetSource("memory://x/*.parquet")
        assert [s.name for s in source.files] == ["1.parquet", "2.parquet"]
        assert ids(source) == [0, 1, 2]
    finally:
        fs.rm("/x", recursive=True)
