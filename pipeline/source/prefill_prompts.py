"""task=score and task=embed: a row's prompt as generation would build it, fitted to `max_model_len` with no
room kept for generated tokens, and for score its candidate completions' tokens.

A candidate's tokens are its text encoded on its own (no special tokens), to be appended to the prompt's
tokens (after the chat template when the job renders one), so the prompt part is exactly what a generate
job would feed the model. The candidates cell (`input.candidates_column`) is a string (one candidate) or a
list of strings; a row without candidates, or with a candidate that is not text or encodes to no tokens, is
an error row. The prompt is fitted with room for the row's longest candidate (score) or none (embed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from pipeline.engine.request import SamplingParams
from pipeline.source.prompts import Prepared


def is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def is_candidates_type(t: pa.DataType) -> bool:
    """A string, or a list of strings."""
    lists = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
    return is_text(t) or (lists and (is_text(t.value_type) or pa.types.is_null(t.value_type)))


def candidate_texts(value: Any, column: str) -> list[str]:
    """The candidates of one cell; ValueError saying why a cell has none that can be scored."""
    if value is None:
        raise ValueError(f"candidates are null (column {column!r})")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence):
        raise ValueError(f"candidates must be a string or a list of strings, got {type(value).__name__} "
                         f"(column {column!r})")
    if not value:
        raise ValueError(f"no candidates: column {column!r} holds an empty list")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise ValueError(f"candidate {i} is not text: {type(text).__name__}")
    return list(value)


@dataclass
class ScorePrepared(Prepared):
    """A score row: `token_ids` is the prompt, `candidates` each candidate's own tokens."""

    candidates: list[list[int]] = dataclasses.field(default_factory=list)


class RowBuilder(Protocol):
    def prepare(self, row: Mapping[str, Any]) -> Prepared: ...

    def seeded(self, prepared: Prepared, row_id: Any) -> SamplingParams: ...


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...


class PrefillPromptBuilder:
    """Wraps the job's prompt builder, which it must give no length limit (`prompts`: it would keep room for
    `sampling.max_tokens`); fits the prompt here instead. `candidates_column`: score's, None for embed."""

    def __init__(self, prompts: RowBuilder, tokenizer: Encoder, max_model_len: int, truncate: str,
                 candidates_column: str | None) -> None:
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.truncate = truncate
        self.column = candidates_column

    def seeded(self, prepared: Prepared, row_id: Any) -> SamplingParams:
        return self.prompts.seeded(prepared, row_id)

    def prepare(self, row: Mapping[str, Any]) -> Prepared:
        prepared = self.prompts.prepare(row)
        if prepared.error is not None:
            return prepared
        tokens = prepared.token_ids
        fields = {f.name: getattr(prepared, f.name) for f in dataclasses.fields(prepared)}
        try:
            if self.column is None:
                tokens = self._fit(tokens, 0)
                return dataclasses.replace(prepared, token_ids=tokens, prompt_tokens=len(tokens))
            candidates = [self._encode(i, text) for i, text in enumerate(candidate_texts(row.get(self.column),
                                                                                         self.column))]
            tokens = self._fit(tokens, max(map(len, candidates)))
        except ValueError as e:
            return Prepared(None, None, str(e), len(tokens))
        return ScorePrepared(**{**fields, "token_ids": tokens, "prompt_tokens": len(tokens)}, candidates=candidates)

    def _encode(self, index: int, text: str) -> list[int]:
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        if not tokens:
            raise ValueError(f"candidate {index} encodes to no tokens")
        return tokens

    def _fit(self, tokens: list[int], longest: int) -> list[int]:
        """The prompt with room for the longest candidate in max_model_len (its last tokens, with
        input.truncate=left)."""
        room = self.max_model_len - longest
        if room < 1:
            raise ValueError(f"the longest candidate has {longest} tokens: no room for a prompt in "
                             f"max_model_len={self.max_model_len}")
        if len(tokens) <= room:
            return tokens
        if self.truncate == "left":
            return tokens[-room:]
        limit = f"max_model_len={self.max_model_len}" + (f" - the longest candidate's {longest}" if longest else "")
        raise ValueError(f"prompt has {len(tokens)} tokens; {limit} allows {room} (input.truncate=left keeps "
                         f"the last {room})")
