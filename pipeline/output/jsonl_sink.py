"""JSON Lines part files (`part-<unit>.jsonl`): the Parquet output's rows one per line, or OpenAI Batch API
output lines, one per request.

A JSON Lines part cannot hold key-value metadata as a Parquet footer does, so its input rows go into its
ledger record (`PartInfo.input_rows`); the model, version and fingerprint are in `_job.json` and
`_metrics.json` beside it. Parts are written through the same commit as Parquet parts (`put`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.output import jsonl_rows
from pipeline.output.ledger import Put
from pipeline.output.openai_responses import request_hash, response_line
from pipeline.output.sink import PartInfo, Sink


class JsonlSink(Sink):
    """The output rows as JSON objects, with the columns of the Parquet output, in its order."""

    suffix = ".jsonl"

    def __init__(self, path: str, schema: pa.Schema, storage_options: dict | None = None) -> None:
        super().__init__(path, storage_options)
        self.columns = schema.names

    def write_rows(self, unit_id: str, rows: list[dict[str, Any]], input_rows: list[int],
                   put: Put | None = None) -> PartInfo:
        data = jsonl_rows.encode({c: row.get(c) for c in self.columns} for row in rows)
        name = self.part_name(unit_id)
        self._put(name, data, "part", put)
        return PartInfo(unit_id, name, len(rows), len(data), [r["id"] for r in rows], input_rows)


class OpenAIBatchSink(Sink):
    """One Batch API output line per input row, its `samples` rows as the choices (`response_line`)."""

    suffix = ".jsonl"
    id_key = "custom_id"
    merges_samples = True

    def __init__(self, path: str, samples: int, model: str, fingerprint: str, defaults: Mapping[str, Any],
                 storage_options: dict | None = None) -> None:
        """`fingerprint`: the job's, from which the request ids derive; `defaults`: how to answer rows that do
        not come from request lines (`response_line`)."""
        super().__init__(path, storage_options)
        self.samples = samples
        self.model = model
        self.fingerprint = fingerprint
        self.defaults = defaults

    def write_rows(self, unit_id: str, rows: list[dict[str, Any]], input_rows: list[int],
                   put: Put | None = None) -> PartInfo:
        created, n = int(time.time()), self.samples
        lines = [response_line(rows[i * n:(i + 1) * n], request_hash(self.fingerprint, row), self.model, created,
                               self.defaults) for i, row in enumerate(input_rows)]
        data = jsonl_rows.encode(lines)
        name = self.part_name(unit_id)
        self._put(name, data, "part", put)
        return PartInfo(unit_id, name, len(lines), len(data), [line["custom_id"] for line in lines], input_rows)
