"""Write results as part files under one output directory, through fsspec: a Parquet dataset (zstd part
files) here, JSON Lines parts in pipeline/output/jsonl_sink.py.

Result rows reach the output only through a sink's `write_rows(unit_id, rows, input_rows, put)`: each call
writes one whole part file, which records the input rows it holds (or hands them back for the ledger
record), and returns what it wrote. A job's `UnitWriter` (pipeline/output/commit.py) passes its fenced commit's `put`
(pipeline/output/fence.py) and adds the ledger record after the part (the commit point); without one the part
is written at once (`ledger.write_whole`: local temp file + fsync + rename; object stores: one PUT of the
final key). Resume and shards choose the unit ids (see pipeline/output/run_state.py). `finish` writes the
run's metrics the same way.
"""

from __future__ import annotations

import json
import posixpath
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from pipeline.output.ledger import INPUT_ROWS_KEY, Put, part_name, write_whole

# Only part files have visible names: dataset readers (pyarrow.dataset, polars, Spark, `datasets`) skip
# names starting with "_" or ".", so everything else the job writes is named that way.
METRICS_FILE = "_metrics.json"
REPORT_DIR = "_report"


def _shard_suffix(num_shards: int, shard_index: int) -> str:
    return "" if num_shards == 1 else f"-shard-{shard_index:05d}-of-{num_shards:05d}"


def metrics_name(num_shards: int = 1, shard_index: int = 0) -> str:
    """`_metrics.json`, or `_metrics-shard-<i>-of-<n>.json` for one shard of a split run."""
    return f"_metrics{_shard_suffix(num_shards, shard_index)}.json"


def report_dir_name(num_shards: int = 1, shard_index: int = 0) -> str:
    """`_report`, or `_report-shard-<i>-of-<n>` for one shard of a split run."""
    return f"{REPORT_DIR}{_shard_suffix(num_shards, shard_index)}"


def result_schema(id_type: pa.DataType, passthrough: Mapping[str, pa.DataType], token_ids: bool,
                  logprobs: bool = False, prompt_logprobs: bool = False) -> pa.Schema:
    """The output columns: id (input type), passthrough columns, then the result of each sample.

    `logprobs`: per generated token, a map from token id to log-probability (the top-k and the chosen one),
    and `logprob_tokens`, the same ids' text. `prompt_logprobs`: the same map per prompt token (null first).
    """
    fields = [pa.field("id", id_type), *(pa.field(n, t) for n, t in passthrough.items())]
    fields += [pa.field("sample_index", pa.int32()), pa.field("text", pa.string())]
    if token_ids:
        fields.append(pa.field("token_ids", pa.list_(pa.int32())))
    if logprobs:
        fields.append(pa.field("logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
        fields.append(pa.field("logprob_tokens", pa.list_(pa.map_(pa.int32(), pa.string()))))
    if prompt_logprobs:
        fields.append(pa.field("prompt_logprobs", pa.list_(pa.map_(pa.int32(), pa.float32()))))
    fields += [
        pa.field("prompt_tokens", pa.int32()),
        pa.field("cached_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("error", pa.string()),
    ]
    return pa.schema(fields)


@dataclass(frozen=True)
class PartInfo:
    """One written part: the commit record a progress ledger needs."""

    unit_id: str
    name: str  # file name under the output directory
    rows: int  # records: output rows, or response lines (output.format=openai_batch)
    bytes: int
    ids: list[Any]  # each record's id as a reader of the part gets it back (the ledger's checksum)
    input_rows: list[int] | None = None  # of a part that cannot hold them itself: its ledger record does


class Sink(ABC):
    """The output directory of one job: its part files, in one format (pipeline/output/formats.py), and its
    metrics."""

    suffix = ".parquet"
    id_key = "id"  # the key of a record's id in a part
    merges_samples = False  # one record per input row, its samples together, instead of one per sample

    def __init__(self, path: str, storage_options: dict | None = None) -> None:
        self.fs, self.root = url_to_fs(path, **(storage_options or {}))

    def part_name(self, unit_id: str) -> str:
        return part_name(unit_id, self.suffix)

    @abstractmethod
    def write_rows(self, unit_id: str, rows: list[dict[str, Any]], input_rows: list[int],
                   put: Put | None = None) -> PartInfo:
        """Write a unit's output rows (in part order: input row, then sample) whole as its part file;
        `input_rows`: the input row of each of its input rows; `put`: what writes it (`write_whole` without
        one)."""

    def finish(self, metrics: Mapping[str, Any], name: str = METRICS_FILE) -> None:
        """Write the run's metrics (`_SUCCESS` is the ledger's: only when every unit is committed)."""
        self._put(name, (json.dumps(metrics, indent=2, default=str) + "\n").encode(), "metrics")

    def finish_once(self, metrics: Mapping[str, Any], name: str) -> None:
        """`finish`, unless that file exists (a run that only completed the bookkeeping keeps the real figures)."""
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(posixpath.join(self.root, name)):
            self.finish(metrics, name)

    def _put(self, name: str, data: bytes, point: str, put: Put | None = None) -> None:
        path = posixpath.join(self.root, name)
        if put is None:
            write_whole(self.fs, path, data, point)  # JobError naming the file
        else:
            put(path, data, point)


class ParquetSink(Sink):
    """Parquet part files with the job's schema and key-value metadata (`INPUT_ROWS_KEY`: their input rows)."""

    def __init__(self, path: str, schema: pa.Schema, metadata: Mapping[str, str], compression: str = "zstd",
                 storage_options: dict | None = None) -> None:
        super().__init__(path, storage_options)
        self.schema = schema.with_metadata({**(schema.metadata or {}), **metadata})
        self.compression = compression

    def write_part(self, unit_id: str, table: pa.Table, input_rows: list[int], put: Put | None = None) -> PartInfo:
        """Write `table` (cast to the output schema) whole as this unit's part file; `input_rows`: the input
        row of each of its input rows (`INPUT_ROWS_KEY`); `put`: what writes it (`write_whole` without one)."""
        table = table.cast(self.schema)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), INPUT_ROWS_KEY: json.dumps(input_rows)})
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf, compression=self.compression)
        data = buf.getvalue().to_pybytes()
        name = self.part_name(unit_id)
        self._put(name, data, "part", put)
        return PartInfo(unit_id, name, table.num_rows, len(data), table.column("id").to_pylist())

    def write_rows(self, unit_id: str, rows: list[dict[str, Any]], input_rows: list[int],
                   put: Put | None = None) -> PartInfo:
        return self.write_part(unit_id, pa.Table.from_pylist(rows, schema=self.schema), input_rows, put)
