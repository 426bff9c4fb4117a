"""JSON Lines input: line splitting and counting, listing (plain and compressed), rows and error rows,
and reading in bounded memory whatever the file size."""

from __future__ import annotations

import gzip
import io
import json
import tracemalloc

import pyarrow as pa
import pytest
import zstandard

from pipeline.errors import JobError
from pipeline.source import jsonl
from pipeline.source.files import BAD_CELLS
from pipeline.source.jsonl import JsonlSource, read_lines, scan


@pytest.mark.parametrize("data", [b"", b"a", b"a\n", b"a\nb", b"a\nb\n", b"\n", b"a\n\nb\n\n", b"a\r\nb\r\n"])
def test_lines_and_their_count_agree(data):
    lines = list(read_lines(io.BytesIO(data)))
    assert lines == data.split(b"\n")[:-1] + ([data.rsplit(b"\n", 1)[-1]] if not data.endswith(b"\n") and data
                                              else [])
    assert scan(io.BytesIO(data))[0] == len(lines)


def test_a_line_longer_than_a_read_block(monkeypatch):
    monkeypatch.setattr(jsonl, "_BLOCK", 4)
    data = b"0123456789\nab\n" + b"x" * 13
    assert list(read_lines(io.BytesIO(data))) == [b"0123456789", b"ab", b"x" * 13]
    assert scan(io.BytesIO(data))[0] == 3


def write_jsonl(path, rows, opener=open):
    path.parent.mkdir(parents=True, exist_ok=True)
    with opener(path, "wb") as f:
        f.write(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return path


ROWS = [{"id": i, "prompt": f"p{i}"} for i in range(5)]


def all_rows(source: JsonlSource, batch_rows: int = 2) -> list[dict]:
    return [r for f, start, b in source.batches([], batch_rows) for r in source.rows(f, start, b)]


def test_directory_of_plain_and_compressed_files(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "in" / "b.jsonl.gz", ROWS[2:4], gzip.open)
    with open(tmp_path / "in" / "c.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(json.dumps(ROWS[4]).encode()))  # no final newline
    (tmp_path / "in" / "notes.txt").write_text("not input")
    source = JsonlSource(str(tmp_path / "in"), "id")
    assert [(f.name, f.num_rows) for f in source.files] == [("a.jsonl", 2), ("b.jsonl.gz", 2), ("c.jsonl.zst", 1)]
    assert all_rows(source) == ROWS
    # the content identity is the text's, however it is compressed
    write_jsonl(tmp_path / "plain" / "b.jsonl", ROWS[2:4])
    assert JsonlSource(str(tmp_path / "plain"), "id").files[0].content == source.files[1].content


def test_lines_without_an_id_and_bad_lines(tmp_path):
    lines = [b'{"prompt": "no id"}', b'{"id": "x", "prompt": "ok"}', b"{not json", b"[1, 2]", b"", b"\xff\xfe",
             b'{"id": null, "prompt": "null id"}']
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    rows = all_rows(JsonlSource(str(path), "id"), batch_rows=3)
    assert len(rows) == 7
    assert rows[0] == {"id": "in.jsonl:0", "prompt": "no id"} and rows[1] == {"id": "x", "prompt": "ok"}
    assert rows[6] == {"id": None, "prompt": "null id"}  # the job makes it an error row: id is null
    bad = {i: r[BAD_CELLS][0] for i, r in enumerate(rows) if BAD_CELLS in r}
    assert sorted(bad) == [2, 3, 4, 5] and rows[2]["id"] == "in.jsonl:2"
    assert bad[2].startswith("line 3 of in.jsonl: not valid JSON (")
    assert bad[3] == "line 4 of in.jsonl: not a JSON object (a JSON list)"
    assert bad[4] == "line 5 of in.jsonl: empty line"
    assert bad[5].startswith("line 6 of in.jsonl: not valid UTF-8")


def test_unreadable_files_are_job_errors(tmp_path):
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(JobError, match="cannot read JSON Lines file bad.jsonl.gz"):
        JsonlSource(str(tmp_path / "bad.jsonl.gz"), "id")
    (tmp_path / "empty").mkdir()
    with pytest.raises(JobError, match="no .jsonl or .jsonl.gz"):
        JsonlSource(str(tmp_path / "empty"), "id")


def test_a_large_file_streams_in_bounded_memory(tmp_path):
    """The listing and the batches hold one read block and one batch of lines: peak memory (Python objects
    and Arrow buffers) stays under a bound that does not depend on the file, here a quarter of its size."""
    line = json.dumps({"prompt": "x" * 180}).encode() + b"\n"
    lines = 140_000  # ~27 MB
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        for _ in range(lines // 1000):
            f.write(line * 1000)
    bound = 6 * 2**20
    assert path.stat().st_size > 4 * bound
    tracemalloc.start()
    try:
        arrow_peak = 0
        source = JsonlSource(str(path), "id")
        batches = 0
        for file, start, batch in source.batches([], 1024):
            arrow_peak = max(arrow_peak, pa.total_allocated_bytes())
            if batches % 50 == 0:  # parsing the lines into rows stays bounded too
                assert len(source.rows(file, start, batch)) == batch.num_rows
            batches += 1
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert source.total_rows == lines and batches == -(-lines // 1024)
    assert python_peak < bound and arrow_peak < bound, (python_peak, arrow_peak)
