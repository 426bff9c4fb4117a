"""`task`: what a job computes for each input row, and the output rows it writes.

`generate` completes the prompt; `score` gives the log-probability of each of the row's candidate
completions after it; `embed` pools the model's final hidden states over it. A task turns a prepared row into
engine requests and their results into the row's output rows, with the output schema and the rows of a row
that failed; reading, planning, units, checkpoints and resumes are the job's, the same for every task.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Protocol

import pyarrow as pa

from pipeline.config import JobConfig
from pipeline.engine.prefill import Prefill
from pipeline.engine.request import Result
from pipeline.model.loader import open_model_file
from pipeline.source.formats import Builder, prompt_builder
from pipeline.source.prefill_prompts import PrefillPromptBuilder
from pipeline.source.prompts import ChatTokenizer, Prepared
from pipeline.task.embed import EmbedRows
from pipeline.task.generate import GenerateRows
from pipeline.task.score import ScoreRows

RowBuilder = Builder | PrefillPromptBuilder


class RowTask(Protocol):
    """One task's requests and output rows for an input row."""

    def schema(self, ids: pa.DataType, passthrough: Mapping[str, pa.DataType]) -> pa.Schema:
        """The output columns: `id` (of type `ids`), the passthrough columns, then the task's own."""
        ...

    def requests(self, prepared: Prepared) -> list[tuple[list[int], Prefill | None]]:
        """The row's engine requests: (prompt token ids, what a prefill-only request asks or None)."""
        ...

    def rows(self, base: dict[str, Any], results: list[Result], prompt_tokens: int, where: str) -> list[dict]:
        """The row's output rows from its requests' results (in request order, then sample order); `where`
        names the input row for an error the engine reports."""
        ...

    def error_rows(self, base: dict[str, Any], error: str, prompt_tokens: int) -> list[dict]:
        """The output rows of a row that cannot run."""
        ...


def row_task(cfg: JobConfig, types: Mapping[str, pa.DataType], model_path: str) -> RowTask:
    """The job's task. `types`: the input columns' (a `logprobs` column may ask for log-probabilities);
    `model_path`: the checkpoint, whose hidden size is an embedding's length (read without the weights)."""
    logprobs = cfg.sampling.logprobs > 0 or "logprobs" in types
    if cfg.task == "score":
        return ScoreRows(logprobs)
    if cfg.task == "embed":
        return EmbedRows(cfg.embed, open_model_file(model_path).config.hidden_size)
    return GenerateRows(cfg.output.token_ids, logprobs, cfg.sampling.prompt_logprobs > 0 or "prompt_logprobs" in types,
                        cfg.sampling.n)


def row_builder(cfg: JobConfig, tokenizer: ChatTokenizer, max_model_len: int) -> RowBuilder:
    """Turns the job's rows into prompts: the input format's builder, which keeps room for `sampling.max_tokens`
    in max_model_len; score and embed generate nothing and fit the prompt themselves (`prefill_prompts`)."""
    if cfg.task == "generate":
        return prompt_builder(cfg, tokenizer, max_model_len)
    column = cfg.input.candidates_column if cfg.task == "score" else None
    return PrefillPromptBuilder(prompt_builder(cfg, tokenizer, sys.maxsize), tokenizer, max_model_len,
                                cfg.input.truncate, column)
