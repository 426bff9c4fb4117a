"""Read prompt rows from Parquet files through fsspec, streaming, in a stable order.

The listing (which files, in which order, how many rows each) is fixed up front from the Parquet footers
alone, so the progress total and any later planning are known before a row is read; the rows themselves
come in record batches of only the needed columns, so memory does not grow with the dataset.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.errors import JobError

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class SourceFile:
    """One input file: `path` on `fs`, `name` relative to the input root (used in ids and messages)."""

    path: str
    name: str
    size: int
    num_rows: int
    schema: pa.Schema
    content: str  # `footer_digest`: changes when the file is rewritten with other values


@dataclass(frozen=True)
class ColumnSpec:
    """A column the job reads: which config key named it, which Arrow types it accepts."""

    name: str
    key: str  # config key that chose the column, for messages
    accepts: Callable[[pa.DataType], bool]
    expected: str  # the accepted types in words
    required: bool = True


# Key of a row dict under which `batch_rows` lists the cells it could not convert (not a str: no column
# can have this name).
BAD_CELLS = object()


def batch_rows(batch: pa.RecordBatch) -> list[dict]:
    """The batch's rows as dicts. A cell that cannot become a Python value (invalid UTF-8 in a string, a
    value nested too deeply for Python) becomes None and is described under `row[BAD_CELLS]`, so its row
    becomes an error row instead of ending the run."""
    try:
        return batch.to_pylist()
    except (UnicodeDecodeError, RecursionError):
        return [_row(batch, i) for i in range(batch.num_rows)]


def _row(batch: pa.RecordBatch, i: int) -> dict:
    row: dict = {}
    bad = []
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column[i].as_py()
        except UnicodeDecodeError as e:
            row[name] = None
            bad.append(f"column {name!r} is not valid UTF-8 (byte {e.start}: {e.reason})")
        except RecursionError:
            row[name] = None
            bad.append(f"column {name!r} is nested too deeply")
    if bad:
        row[BAD_CELLS] = bad
    return row


def listing(fs: fsspec.AbstractFileSystem, path: str, shown: str,
            suffixes: tuple[str, ...] = (".parquet",)) -> list[tuple[str, int]]:
    """(path, size) of the files one input.path entry names, sorted; a directory's are those below it whose
    names end with one of `suffixes`."""
    if any(c in path for c in _GLOB_CHARS):
        found = fs.glob(path, detail=True)
        files = [(p, info.get("size") or 0) for p, info in found.items() if info.get("type") == "file"]
        if not files:
            raise JobError(f"input.path {shown!r} matches no files")
    elif fs.isdir(path):
        found = fs.find(path, detail=True)
        files = [
            (p, info.get("size") or 0)
            for p, info in found.items()
            if p.endswith(suffixes) and not posixpath.basename(p).startswith(("_", "."))
        ]
        if not files:
            raise JobError(f"input.path {shown!r} is a directory with no {' or '.join(suffixes)} files")
    elif fs.isfile(path):
        files = [(path, fs.size(path) or 0)]
    else:
        raise JobError(f"input.path {shown!r}: no such file or directory")
    return sorted(files)


def footer_digest(f: BinaryIO) -> str:
    """sha256 of a Parquet file's footer: row groups, column chunk offsets and sizes, min/max statistics.

    Why: the content identity of an input file that costs one small read however large the file is. A
    rewrite with other values changes chunk sizes or statistics even when the size and row count stay.
    """
    f.seek(-8, 2)
    tail = f.read(8)
    if tail[4:] != b"PAR1":
        raise ValueError("not a Parquet file (no PAR1 magic at its end)")
    length = int.from_bytes(tail[:4], "little")
    f.seek(-8 - length, 2)
    return hashlib.sha256(f.read(length)).hexdigest()


def _read_footer(fs: fsspec.AbstractFileSystem, path: str, name: str) -> tuple[int, pa.Schema, str]:
    try:
        with fs.open(path, "rb") as f:
            meta = pq.read_metadata(f)
            return meta.num_rows, meta.schema.to_arrow_schema(), footer_digest(f)
    except Exception as e:
        raise JobError(f"cannot read Parquet file {name}: {e}") from None


def list_input(path: str | Sequence[str], suffixes: tuple[str, ...],
               storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, list[tuple[str, str, int]]]:
    """The filesystem and the (path, name, size) of every input file, in listing order: each entry sorted, a
    file named twice read once; `name` is relative to the files' common folder (used in ids and messages)."""
    entries = [path] if isinstance(path, str) else list(path)
    if not entries:
        raise JobError("input.path is an empty list")
    fs, _ = url_to_fs(entries[0], **(storage_options or {}))
    listed: dict[str, int] = {}  # path -> size, in listing order
    for entry in entries:
        entry_fs, entry_path = url_to_fs(entry, **(storage_options or {}))
        if entry_fs.protocol != fs.protocol:
            raise JobError(f"input.path mixes filesystems: {entries[0]!r} and {entry!r}")
        for p, size in listing(fs, entry_path, entry, suffixes):
            listed.setdefault(p, size)
    files = list(listed.items())
    root = posixpath.commonpath([p for p, _ in files]) if len(files) > 1 else posixpath.dirname(files[0][0])
    return fs, [(p, posixpath.relpath(p, root) if root else p, size) for p, size in files]


class InputFiles:
    """Listed input files on one filesystem: what the plan, the fingerprint and `verify` need of any format."""

    fs: fsspec.AbstractFileSystem
    files: list[SourceFile]
    carried: tuple[str, ...] = ()  # row keys the job copies to its output rows for the output format

    def content(self) -> dict[str, str]:
        """Each file's content identity, by name (part of the job fingerprint)."""
        return {f.name: f.content for f in self.files}

    def urls(self) -> dict[str, str]:
        """Each file's full URL, by name (recorded so that `verify` can re-check the input)."""
        return {f.name: self.fs.unstrip_protocol(f.path) for f in self.files}

    @property
    def total_rows(self) -> int:
        return sum(s.num_rows for s in self.files)


class ParquetSource(InputFiles):
    """The input files of one job, checked against the columns it needs."""

    def __init__(self, path: str | Sequence[str], storage_options: dict | None = None) -> None:
        self.fs, files = list_input(path, (".parquet",), storage_options)
        self.files = []
        for p, name, size in files:
            num_rows, schema, content = _read_footer(self.fs, p, name)
            self.files.append(SourceFile(p, name, size, num_rows, schema, content))

    def check_columns(self, specs: Sequence[ColumnSpec]) -> dict[str, pa.DataType]:
        """Check every file has each required column with an accepted type, the same in every file.

        Returns the type of each present column; raises JobError naming the file, column and key.
        """
        types: dict[str, pa.DataType] = {}
        for spec in specs:
            for file in self.files:
                if spec.name not in file.schema.names:
                    if not spec.required:
                        continue
                    raise JobError(
                        f"{file.name}: no column {spec.name!r} (set by {spec.key}); available columns: "
                        f"{', '.join(file.schema.names)}"
                    )
                dtype = file.schema.field(spec.name).type
                if not (spec.accepts(dtype) or pa.types.is_null(dtype)):
                    raise JobError(
                        f"{file.name}: column {spec.name!r} ({spec.key}) has type {dtype}, expected {spec.expected}"
                    )
                seen = types.setdefault(spec.name, dtype)
                if pa.types.is_null(seen):
                    types[spec.name] = seen = dtype
                if dtype != seen and not pa.types.is_null(dtype):
                    raise JobError(
                        f"{file.name}: column {spec.name!r} has type {dtype} but earlier files have {seen}"
                    )
        return types

    def id_field(self, column: str, types: dict[str, pa.DataType]) -> tuple[str, pa.DataType] | None:
        """(the id column, its type), or None when ids are `<file>:<row>`; every file must agree on which."""
        having = [s.name for s in self.files if column in s.schema.names]
        if having and len(having) < len(self.files):
            lacking = next(s.name for s in self.files if column not in s.schema.names)
            raise JobError(f"{lacking}: no id column {column!r} (input.id_column) although {having[0]} has one")
        return (column, types[column]) if having else None

    def rows(self, file: SourceFile, start: int, batch: pa.RecordBatch) -> list[dict]:
        """The rows of one of `batches`' batches, as the job reads them (`batch_rows`)."""
        return batch_rows(batch)

    def batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[tuple[SourceFile, int, pa.RecordBatch]]:
        """Yield (file, index of the batch's first row in the file, batch) in listing order.

        Columns a file lacks (optional ones) are simply absent from its batches.
        """
        for file in self.files:
            start = 0
            try:
                for batch in read_batches(self.fs, file.path, columns, batch_rows):
                    yield file, start, batch
                    start += batch.num_rows
            except (OSError, pa.ArrowException) as e:
                raise JobError(f"cannot read Parquet file {file.name} near row {start}: {e}") from None


def read_batches(fs: fsspec.AbstractFileSystem, path: str, columns: Sequence[str],
                 batch_rows: int) -> Iterator[pa.RecordBatch]:
    """One file's record batches of those `columns` it has (optional ones may be absent), in that order."""
    with fs.open(path, "rb") as f:
        parquet = pq.ParquetFile(f)
        present = [c for c in columns if c in parquet.schema_arrow.names]
        yield from parquet.iter_batches(batch_size=batch_rows, columns=present)
