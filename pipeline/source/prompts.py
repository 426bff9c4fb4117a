"""One input row -> prompt token ids and sampling parameters, or the reason it cannot run.

Every problem with a single row (null or empty prompt, malformed messages, unknown role, a prompt too long
for the model, a bad per-row sampling value) becomes an error string here, never an exception: one bad
row must not stop a run of millions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec

from pipeline.config import InputConfig
from pipeline.engine.request import SamplingParams
from pipeline.errors import JobError
from pipeline.seeds import row_seed
from pipeline.source.files import BAD_CELLS
from pipeline.source.json_text import parse_json
from pipeline.source.sampling_columns import cell_value

ROLES = ("system", "user", "assistant")


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...

    def with_chat_template(self, template: str, origin: str) -> ChatTokenizer: ...


@dataclass
class Prepared:
    """A row ready for the engine (`token_ids`, `sampling`) or rejected (`error`)."""

    token_ids: list[int] | None
    sampling: SamplingParams | None
    error: str | None = None
    prompt_tokens: int = 0  # tokens of the (possibly truncated) prompt; known for over-long rows too
    own_seed: bool = False  # the row's seed column set `sampling.seed`
    adapter: str | None = None  # the row's LoRA adapter (input.lora_column); None: the base model


class RowError(ValueError):
    """Why one row cannot run (caught by `PromptBuilder.prepare`, written as the row's `error`)."""


def _parse_messages(value: Any) -> list[dict]:
    """Check a messages cell (list of {role, content}, or that list as a JSON string)."""
    if value is None:
        raise RowError("messages is null")
    if isinstance(value, str):
        try:
            value = parse_json(value)
        except ValueError as e:
            raise RowError(f"malformed messages: {e}") from None
    if not isinstance(value, list):
        raise RowError(f"malformed messages: expected a list of {{role, content}}, got {type(value).__name__}")
    if not value:
        raise RowError("messages is an empty list")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RowError(f"malformed messages: item {i} has no role")
        if m["role"] not in ROLES:
            raise RowError(f"unknown role {m['role']!r} in message {i}; expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RowError(f"malformed messages: item {i} ({m['role']}) has no text content")
        messages.append({"role": m["role"], "content": m["content"]})
    if all(not m["content"].strip() for m in messages):
        raise RowError("messages have only empty content")
    return messages


def _missing(value: Any) -> bool:
    """Null, or NaN (how pandas writes a missing value in a float column)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def _valid(base: SamplingParams, key: str, value: Any) -> bool:
    """Whether `key=value` alone makes valid sampling parameters (to name the bad column of several)."""
    try:
        dataclasses.replace(base, **{key: value})
    except ValueError:
        return False
    return True


def chat_template_source(value: str) -> tuple[str, str]:
    """(Jinja source, where it came from) of a string `input.chat_template`: the template itself when it
    holds Jinja markup, else the text of the file at that path or fsspec URL."""
    if "{{" in value or "{%" in value:
        return value, "input.chat_template"
    try:
        with fsspec.open(value, "r", encoding="utf-8") as f:
            return f.read(), value
    except (OSError, ValueError, ImportError) as e:  # ImportError: the URL's fsspec backend is not installed
        raise JobError(f"invalid config `input.chat_template`: cannot read template file {value!r}: {e}") from None


def chat_tokenizer(tokenizer: ChatTokenizer, inp: InputConfig) -> ChatTokenizer:
    """`tokenizer` rendering with the job's own template when `input.chat_template` is one (or its file), else
    unchanged. JobError when the template cannot be read or does not compile: a job-level mistake, found
    before the model loads (`pipeline.preflight`)."""
    if not isinstance(inp.chat_template, str):
        return tokenizer
    try:
        return tokenizer.with_chat_template(*chat_template_source(inp.chat_template))
    except ValueError as e:
        raise JobError(f"invalid config `input.chat_template`: {e}") from None


class PromptBuilder:
    """Applies the input section of the config to rows, with the model's tokenizer and length limit."""

    def __init__(self, tokenizer: ChatTokenizer, inp: InputConfig, sampling: SamplingParams,
                 max_model_len: int, job_seed: int = 0) -> None:
        self.tokenizer = chat_tokenizer(tokenizer, inp)
        self.template_kwargs = dict(inp.chat_template_kwargs or {})
        self.inp = inp
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.job_seed = sampling.seed if sampling.seed is not None else job_seed

    def seeded(self, prepared: Prepared, row_id: Any) -> SamplingParams:
        """The row's sampling with its own seed: the row's seed column, else `row_seed(job seed, row id)`."""
        sampling = prepared.sampling
        assert sampling is not None, "an error row has no sampling"
        if prepared.own_seed or sampling.greedy:
            return sampling
        return dataclasses.replace(sampling, seed=row_seed(self.job_seed, row_id))

    def prepare(self, row: Mapping[str, Any]) -> Prepared:
        """The row's prompt and sampling, or an error row's reason (never raises for bad row content)."""
        tokens: list[int] = []
        if BAD_CELLS in row:
            return Prepared(None, None, "; ".join(row[BAD_CELLS]))
        try:
            sampling = self._sampling(row)
            adapter = self._adapter(row)
            tokens = self._encode(self._text(row))
            fitted = self._fit(tokens, sampling.max_tokens)
        except RowError as e:
            return Prepared(None, None, str(e), len(tokens))
        own_seed = "seed" in self.inp.sampling_columns and not _missing(row.get("seed"))
        return Prepared(fitted, sampling, None, len(fitted), own_seed, adapter)

    def _adapter(self, row: Mapping[str, Any]) -> str | None:
        """The row's LoRA adapter name or folder (None: the base model); the engine judges whether it runs."""
        column = self.inp.lora_column
        value = row.get(column) if column else None
        if value is None:
            return None
        if not isinstance(value, str):
            raise RowError(f"adapter is not text: {type(value).__name__} (column {column!r})")
        return value.strip() or None

    def _sampling(self, row: Mapping[str, Any]) -> SamplingParams:
        overrides = {}
        for column in self.inp.sampling_columns:
            if not _missing(row.get(column)):
                try:
                    overrides[column] = cell_value(column, row[column])
                except ValueError as e:
                    raise RowError(f"bad per-row sampling value in column {column!r}: {e}") from None
        if not overrides:
            return self.sampling
        try:
            return dataclasses.replace(self.sampling, **overrides)
        except ValueError as e:
            culprits = [c for c in overrides if not _valid(self.sampling, c, overrides[c])] or list(overrides)
            raise RowError(f"bad per-row sampling value in column {', '.join(map(repr, culprits))}: {e}") from None

    def _text(self, row: Mapping[str, Any]) -> str:
        inp = self.inp
        system = [{"role": "system", "content": inp.system_prompt}] if inp.system_prompt else []
        if inp.messages_column:
            messages = _parse_messages(row.get(inp.messages_column))
            if messages[0]["role"] != "system":
                messages = system + messages
            return self._render(messages)
        prompt = row.get(inp.prompt_column)
        if prompt is None:
            raise RowError(f"prompt is null (column {inp.prompt_column!r})")
        if not isinstance(prompt, str):
            raise RowError(f"prompt is not text: {type(prompt).__name__}")
        if not prompt.strip():
            raise RowError(f"prompt is empty (column {inp.prompt_column!r})")
        if inp.chat_template:
            return self._render([*system, {"role": "user", "content": prompt}])
        return f"{inp.system_prompt}\n\n{prompt}" if inp.system_prompt else prompt

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **self.template_kwargs)
        except Exception as e:  # the model's own Jinja template may reject a conversation
            raise RowError(f"chat template failed: {e}") from None

    def _encode(self, text: str) -> list[int]:
        tokens = self.tokenizer.encode(text)
        if not tokens:
            raise RowError("prompt encodes to no tokens")
        return tokens

    def _fit(self, tokens: list[int], max_tokens: int) -> list[int]:
        room = self.max_model_len - max_tokens
        if room < 1:
            raise RowError(f"max_tokens={max_tokens} leaves no room for a prompt in max_model_len={self.max_model_len}")
        if len(tokens) <= room:
            return tokens
        if self.inp.truncate == "left":
            return tokens[-room:]
        raise RowError(
            f"prompt has {len(tokens)} tokens; max_model_len={self.max_model_len} - max_tokens={max_tokens} "
            f"allows {room} (input.truncate=left keeps the last {room})"
        )
