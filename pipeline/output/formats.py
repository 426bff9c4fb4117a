"""`output.format`: which sink writes the parts, and what `verify` reads back from them."""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.output.jsonl_sink import JsonlSink, OpenAIBatchSink
from pipeline.output.sink import ParquetSink, Sink

SINKS: dict[str, type[Sink]] = {"parquet": ParquetSink, "jsonl": JsonlSink, "openai_batch": OpenAIBatchSink}


def make_sink(cfg: JobConfig, schema: pa.Schema, metadata: Mapping[str, str]) -> Sink:
    """The job's sink. Batch API output lines of rows that are not requests (a Parquet or JSON Lines input)
    answer as the rows were run: embeddings under task=embed, chat completions when the chat template renders
    the rows, else text completions, with the job's `sampling.logprobs` alternatives."""
    fmt, path = cfg.output_format, cfg.output.path
    if fmt == "jsonl":
        return JsonlSink(path, schema)
    if fmt == "openai_batch":
        chat = bool(cfg.input.messages_column or cfg.input.chat_template)
        kind = "embedding" if cfg.task == "embed" else "chat.completion" if chat else "text_completion"
        defaults = {"object": kind, "top_logprobs": cfg.sampling.logprobs or None}
        return OpenAIBatchSink(path, cfg.sampling.n, metadata["pipeline.model"],
                               metadata["pipeline.config_fingerprint"], defaults)
    return ParquetSink(path, schema, metadata, cfg.output.compression)
