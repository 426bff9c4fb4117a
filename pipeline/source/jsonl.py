"""Read JSON Lines files (one JSON object per line, plain or compressed) through fsspec, streaming.

Why this shape: the plan needs every file's row count before a row is read (unit ids depend on it), and a
JSON Lines file has no footer that says it. So the listing reads each file once, counting its lines and
hashing its (decompressed) bytes: that hash is the file's content identity in the job fingerprint, so a
file edited between a crash and the resume is refused, as a changed Parquet footer is. The rows then
stream in Arrow batches of `input.batch_rows` raw lines (one binary `line` column): a window a run does not
need is skipped without parsing, and the row digests (pipeline/plan/digests.py) hash the lines as stored.
A line is parsed only when its window runs; one that is not a JSON object becomes an error row naming
its line, never an exception. Memory holds one read block and one batch of lines, whatever the file size.

Compression follows the file name (`.gz`, `.zst`, `.bz2`, `.xz`: fsspec's `compression="infer"`). A
compressed stream cannot seek, and neither does this reader: every read starts at the top of the file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import fsspec
import pyarrow as pa

from pipeline.errors import JobError
from pipeline.source.files import BAD_CELLS, ColumnSpec, InputFiles, SourceFile, list_input
from pipeline.source.json_text import parse_json

SUFFIXES = tuple(f".jsonl{c}" for c in ("", ".gz", ".zst", ".bz2", ".xz"))
LINE_SCHEMA = pa.schema([("line", pa.binary())])
_BLOCK = 1 << 20  # bytes read at a time


def as_text(value: Any) -> str | None:
    """A JSON value as text: a string as it is, null as null, anything else as its JSON (`7` -> `"7"`)."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


class LineError(ValueError):
    """Why one line is not a row (written as its row's error, with the line's number and file)."""


def read_lines(f: BinaryIO) -> Iterator[bytes]:
    """Each line of `f`, without its newline; a final newline does not start another line."""
    pending: list[bytes] = []
    while block := f.read(_BLOCK):
        parts = block.split(b"\n")
        pending.append(parts[0])
        if len(parts) > 1:
            yield b"".join(pending)
            yield from parts[1:-1]
            pending = [parts[-1]]
    last = b"".join(pending)
    if last:
        yield last


def scan(f: BinaryIO) -> tuple[int, str]:
    """(lines as `read_lines` counts them, sha256 of the bytes): one pass, one block in memory."""
    digest, lines, last = hashlib.sha256(), 0, b"\n"
    while block := f.read(_BLOCK):
        digest.update(block)
        lines += block.count(b"\n")
        last = block[-1:]
    return lines + (last != b"\n"), digest.hexdigest()


def open_text(fs: fsspec.AbstractFileSystem, path: str) -> BinaryIO:
    """The file's bytes, decompressed as its name says."""
    return fs.open(path, "rb", compression="infer")


def line_batches(fs: fsspec.AbstractFileSystem, path: str, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The file's lines in record batches of `batch_rows` (the `line` column)."""
    with open_text(fs, path) as f:
        lines = read_lines(f)
        while chunk := list(itertools.islice(lines, batch_rows)):
            yield pa.record_batch([pa.array(chunk, pa.binary())], schema=LINE_SCHEMA)


def parse_line(raw: bytes) -> dict[str, Any]:
    """One line's JSON object; LineError says why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(f"not valid UTF-8 (byte {e.start}: {e.reason})") from None
    if not text.strip():
        raise LineError("empty line")
    try:
        value = parse_json(text)
    except ValueError as e:
        raise LineError(str(e)) from None
    if not isinstance(value, dict):
        raise LineError(f"not a JSON object (a JSON {type(value).__name__})")
    return value


class JsonlSource(InputFiles):
    """JSON Lines input files: each line's keys are the row's columns, as a Parquet file's columns are.

    Values keep their JSON types, but for `text_columns` (`as_text`): a Parquet output's ids and passthrough
    columns, which need one Arrow type. A line without `id_column` gets the id `<file>:<row>`.
    """

    def __init__(self, path: str | Sequence[str], id_column: str, text_columns: Sequence[str] = (),
                 storage_options: dict | None = None) -> None:
        self.fs, listed = list_input(path, SUFFIXES, storage_options)
        self.id_column = id_column
        self.text_columns = text_columns
        self.files = []
        for p, name, size in listed:
            try:
                with open_text(self.fs, p) as f:
                    num_rows, content = scan(f)
            except Exception as e:  # each codec raises its own error types (zstd, lzma, gzip's EOFError)
                raise JobError(f"cannot read JSON Lines file {name}: {e}") from None
            self.files.append(SourceFile(p, name, size, num_rows, LINE_SCHEMA, content))

    def check_columns(self, specs: Sequence[ColumnSpec]) -> dict[str, pa.DataType]:
        """Every column may be present: a line's keys are only known once it is parsed, and a line without
        a required column (the prompt) is an error row. Values are JSON, typed as text in Parquet output."""
        return {spec.name: pa.string() for spec in specs}

    def id_field(self, column: str, types: dict[str, pa.DataType]) -> tuple[str, pa.DataType] | None:
        return column, pa.string()

    def batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[tuple[SourceFile, int, pa.RecordBatch]]:
        """(file, index of the batch's first line in the file, batch of raw lines) in listing order."""
        for file in self.files:
            start = 0
            try:
                for batch in line_batches(self.fs, file.path, batch_rows):
                    yield file, start, batch
                    start += batch.num_rows
            except Exception as e:  # as in __init__
                raise JobError(f"cannot read JSON Lines file {file.name} near line {start + 1}: {e}") from None

    def rows(self, file: SourceFile, start: int, batch: pa.RecordBatch) -> list[dict]:
        """The batch's lines as rows; a line that is not a JSON object is an error row naming the line."""
        rows = [self.row(file, start + i, raw) for i, raw in enumerate(batch.column(0).to_pylist())]
        for row in rows:
            row.update((c, as_text(row[c])) for c in self.text_columns if c in row)
        return rows

    def row(self, file: SourceFile, index: int, raw: bytes) -> dict:
        try:
            row = parse_line(raw)
        except LineError as e:
            return {self.id_column: f"{file.name}:{index}", BAD_CELLS: [f"line {index + 1} of {file.name}: {e}"]}
        row.setdefault(self.id_column, f"{file.name}:{index}")
        return row
