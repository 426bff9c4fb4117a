"""task=generate: one request per row, and one output row per sample: its completion."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.engine.prefill import Prefill
from pipeline.engine.request import Result
from pipeline.output.sink import result_schema
from pipeline.source.prompts import Prepared


def error_row(base: dict[str, Any], index: int, error: str, prompt_tokens: int) -> dict[str, Any]:
    """Sample `index` of an input row that did not run: `text` and the other outputs null."""
    return {**base, "sample_index": index, "text": None, "token_ids": None, "logprobs": None,
            "logprob_tokens": None, "prompt_logprobs": None, "prompt_tokens": prompt_tokens, "cached_tokens": 0,
            "completion_tokens": 0, "finish_reason": "error", "error": error}


class GenerateRows:
    """`samples` (sampling.n) output rows per input row; the optional columns as `result_schema` takes them."""

    def __init__(self, token_ids: bool, logprobs: bool, prompt_logprobs: bool, samples: int) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.samples = samples

    def schema(self, ids: pa.DataType, passthrough: Mapping[str, pa.DataType]) -> pa.Schema:
        return result_schema(ids, passthrough, self.token_ids, self.logprobs, self.prompt_logprobs)

    def requests(self, prepared: Prepared) -> list[tuple[list[int], Prefill | None]]:
        return [(prepared.token_ids, None)]

    def rows(self, base: dict[str, Any], results: list[Result], prompt_tokens: int, where: str) -> list[dict]:
        return [self._row(base, r, where) for r in results]

    def error_rows(self, base: dict[str, Any], error: str, prompt_tokens: int) -> list[dict]:
        return [error_row(base, index, error, prompt_tokens) for index in range(self.samples)]

    @staticmethod
    def _row(base: dict[str, Any], result: Result, where: str) -> dict[str, Any]:
        if result.finish_reason == "error":  # the engine refused the row's own values (a `regex` column, ...)
            return error_row(base, result.sample_index, f"{where}: {result.error}", result.prompt_tokens)
        return {
            **base, "sample_index": result.sample_index, "text": result.text, "token_ids": result.token_ids,
            "logprobs": result.logprobs, "logprob_tokens": result.logprob_tokens,
            "prompt_logprobs": result.prompt_logprobs, "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "completion_tokens": result.completion_tokens,
            "finish_reason": result.finish_reason, "error": result.error,
        }
