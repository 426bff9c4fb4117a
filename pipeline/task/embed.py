"""task=embed: one prefill-only request per row, and one output row: the pooled final hidden state
(`embed.pooling`, `embed.normalize`; see `pipeline.engine.prefill`) as a fixed-size list of float32."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from pipeline.engine.prefill import Embed, Prefill
from pipeline.engine.request import Result
from pipeline.source.prompts import Prepared


class EmbedRows:
    """`size`: the model's hidden size, the embedding's length."""

    def __init__(self, task: Embed, size: int) -> None:
        self.task = task
        self.size = size

    def schema(self, ids: pa.DataType, passthrough: Mapping[str, pa.DataType]) -> pa.Schema:
        how = {"pooling": self.task.pooling, "normalize": str(self.task.normalize).lower()}
        return pa.schema([
            pa.field("id", ids), *(pa.field(n, t) for n, t in passthrough.items()),
            pa.field("embedding", pa.list_(pa.float32(), self.size), metadata=how),
            pa.field("prompt_tokens", pa.int32()), pa.field("cached_tokens", pa.int32()),
            pa.field("error", pa.string()),
        ])

    def requests(self, prepared: Prepared) -> list[tuple[list[int], Prefill | None]]:
        return [(prepared.token_ids, self.task)]

    def rows(self, base: dict[str, Any], results: list[Result], prompt_tokens: int, where: str) -> list[dict]:
        (result,) = results
        if result.finish_reason == "error":
            return self.error_rows(base, f"{where}: {result.error}", prompt_tokens)
        return [{**base, "embedding": result.embedding, "prompt_tokens": prompt_tokens,
                 "cached_tokens": result.cached_tokens, "error": None}]

    def error_rows(self, base: dict[str, Any], error: str, prompt_tokens: int) -> list[dict]:
        return [{**base, "embedding": None, "prompt_tokens": prompt_tokens, "cached_tokens": 0, "error": error}]
