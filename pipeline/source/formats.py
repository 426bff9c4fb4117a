"""`input.format`: which reader lists and reads the input files, and which builder turns rows into prompts.

Every format gives the job the same things (the `Source` protocol): a listing with row counts and content
identities known before a row is read, record batches in listing order, and rows (dicts) made from them.
`verify` reads the input again through `content_digest` and `file_batches`, without the job's config.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import fsspec
import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.source.files import ColumnSpec, ParquetSource, SourceFile, footer_digest, read_batches
from pipeline.source.jsonl import JsonlSource, line_batches, open_text, scan
from pipeline.source.openai_batch import ID_KEY, OpenAIBatchSource, RequestPromptBuilder
from pipeline.source.prompts import ChatTokenizer, PromptBuilder

Builder = PromptBuilder | RequestPromptBuilder


class Source(Protocol):
    """The input files of one job, in one format."""

    fs: fsspec.AbstractFileSystem
    files: list[SourceFile]
    carried: tuple[str, ...]  # row keys the job copies to its output rows for the output format

    def content(self) -> dict[str, str]: ...

    def urls(self) -> dict[str, str]: ...

    @property
    def total_rows(self) -> int: ...

    def check_columns(self, specs: Sequence[ColumnSpec]) -> dict[str, pa.DataType]: ...

    def id_field(self, column: str, types: dict[str, pa.DataType]) -> tuple[str, pa.DataType] | None: ...

    def batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[tuple[SourceFile, int, pa.RecordBatch]]: ...

    def rows(self, file: SourceFile, start: int, batch: pa.RecordBatch) -> list[dict]: ...


def open_source(cfg: JobConfig, task: str = "generate") -> Source:
    """The job's input files, listed (a JSON Lines file is read once to count its lines). A JSON input's
    ids and passthrough values, which have no one Arrow type, are text in a Parquet output."""
    inp = cfg.input
    text = (inp.id_column, *inp.passthrough_columns) if cfg.output_format == "parquet" else ()
    if inp.format == "jsonl":
        return JsonlSource(inp.path, inp.id_column, text)
    if inp.format == "openai_batch":
        return OpenAIBatchSource(inp.path, task, cfg.sampling.n, (ID_KEY,) if text else ())
    return ParquetSource(inp.path)


def prompt_builder(cfg: JobConfig, tokenizer: ChatTokenizer, max_model_len: int) -> Builder:
    """The row -> prompt builder of the job's input format."""
    make = RequestPromptBuilder if cfg.input.format == "openai_batch" else PromptBuilder
    return make(tokenizer, cfg.input, cfg.sampling, max_model_len, cfg.engine.seed)


def content_digest(fmt: str, fs: fsspec.AbstractFileSystem, path: str) -> str:
    """An input file's content identity as the listing of `input.format=fmt` records it."""
    with (fs.open(path, "rb") if fmt == "parquet" else open_text(fs, path)) as f:
        return footer_digest(f) if fmt == "parquet" else scan(f)[1]


def file_batches(fmt: str, fs: fsspec.AbstractFileSystem, path: str, columns: Sequence[str],
                 batch_rows: int) -> Iterator[pa.RecordBatch]:
    """One input file's record batches as the job of `input.format=fmt` reads them (for the row digests)."""
    if fmt == "parquet":
        return read_batches(fs, path, columns, batch_rows)
    return line_batches(fs, path, batch_rows)
