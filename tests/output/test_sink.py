"""Part files, their schema and metadata, and the output directory's rules, local and in memory."""

from __future__ import annotations

import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.sink import ParquetSink, metrics_name, result_schema

META = {"pipeline.model": "m", "pipeline.version": "9"}


def row(i, **extra):
    return {"id": i, "topic": f"t{i}", "sample_index": 0, "text": f"out {i}", "token_ids": [i, i + 1],
            "prompt_tokens": 3, "cached_tokens": 1, "completion_tokens": 2, "finish_reason": "stop",
            "error": None, **extra}


def sink_at(url, token_ids=True):
    return ParquetSink(url, result_schema(pa.int64(), {"topic": pa.string()}, token_ids), META)


def test_result_schema_columns_and_types():
    schema = result_schema(pa.string(), {"a": pa.float64()}, token_ids=True)
    assert schema.names == ["id", "a", "sample_index", "text", "token_ids", "prompt_tokens", "cached_tokens",
                            "completion_tokens", "finish_reason", "error"]
    assert schema.field("token_ids").type == pa.list_(pa.int32())
    assert {schema.field(n).type for n in ("sample_index", "prompt_tokens", "cached_tokens",
                                           "completion_tokens")} == {pa.int32()}
    assert "token_ids" not in result_schema(pa.string(), {}, token_ids=False).names


def test_write_part_is_zstd_parquet_with_metadata(tmp_path):
    sink = sink_at(str(tmp_path / "out"))
    info = sink.write_rows("00003", [row(1), row(2)], [7, 4])
    path = tmp_path / "out" / "part-00003.parquet"
    assert info.name == "part-00003.parquet" and info.rows == 2 and info.bytes == path.stat().st_size
    meta = pq.read_metadata(path)
    assert meta.row_group(0).column(0).compression == "ZSTD"
    assert {k.decode(): v.decode() for k, v in meta.metadata.items() if k.startswith(b"pipeline.")} == {
        **META, "pipeline.input_rows": "[7, 4]"}  # the input row of each row
    assert pq.read_table(path).to_pylist() == [row(1), row(2)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00003.parquet"]  # no temp files


def test_finish_writes_metrics(tmp_path):
    # `_SUCCESS` is the ledger's (tests/output): written only once every unit is committed.
    sink = sink_at(str(tmp_path))
    sink.finish({"rows": 5})
    sink.finish({"rows": 2}, name=metrics_name(2, 1))
    assert json.loads((tmp_path / "_metrics.json").read_text()) == {"rows": 5}
    assert json.loads((tmp_path / "_metrics-shard-00001-of-00002.json").read_text()) == {"rows": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_metrics-shard-00001-of-00002.json", "_metrics.json"]


def test_wrong_row_types_are_not_written(tmp_path):
    sink = sink_at(str(tmp_path))
    with pytest.raises((pa.ArrowInvalid, pa.ArrowTypeError)):
        sink.write_rows("0", [row(1, id="not an int")], [0])
    assert list(tmp_path.iterdir()) == []


def test_memory_filesystem_round_trip():
    fs = fsspec.filesystem("memory")
    try:
        sink = sink_at("memory://sinktest/out", token_ids=False)
        sink.write_rows("00000", [row(1)], [0])
        sink.finish({"rows": 1})
        assert sorted(fs.ls("/sinktest/out", detail=False)) == [
            "/sinktest/out/_metrics.json", "/sinktest/out/part-00000.parquet"]
        with fs.open("/sinktest/out/part-00000.parquet", "rb") as f:
            table = pq.read_table(f)
        assert table.column("text").to_pylist() == ["out 1"] and "token_ids" not in table.column_names
    finally:
        fs.rm("/sinktest", recursive=True)
