"""Per-row sampling overrides: any `SamplingParams` key (but `n`) may come from a column of the same name.

One mechanism for every key: the field's type hint says which Parquet types the column may have and how a
cell becomes the field's value. Lists and mappings may also be given as JSON text (`'["###"]'`,
`'{"50256": -100}'`), which is what a CSV-born dataset usually holds.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

import pyarrow as pa

from pipeline.engine.request import SamplingParams
from pipeline.source.json_text import parse_json

_HINTS = typing.get_type_hints(SamplingParams)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _is_list_of(item: Callable[[pa.DataType], bool]) -> Callable[[pa.DataType], bool]:
    return lambda t: _is_text(t) or ((pa.types.is_list(t) or pa.types.is_large_list(t)) and item(t.value_type))


def _is_bias_map(t: pa.DataType) -> bool:
    return _is_text(t) or (pa.types.is_map(t) and pa.types.is_integer(t.key_type) and _is_number(t.item_type))


def _kind(key: str) -> str:
    """int | float | bool | text | strings | ints | bias: how `key`'s column is typed and read."""
    hint = _HINTS[key]
    if hint in (int, int | None):
        return "int"
    if hint == str | None:
        return "text"
    if typing.get_origin(hint) is tuple:
        return "strings" if typing.get_args(hint)[0] is str else "ints"
    if typing.get_origin(hint) is dict:
        return "bias"
    return {float: "float", bool: "bool"}[hint]


_ACCEPTS: dict[str, tuple[Callable[[pa.DataType], bool], str]] = {
    "int": (_is_number, "an integer"),
    "float": (_is_number, "a number"),
    "bool": (pa.types.is_boolean, "a boolean"),
    "text": (_is_text, "string"),
    "strings": (_is_list_of(_is_text), "list<string> or JSON text"),
    "ints": (_is_list_of(pa.types.is_integer), "list<integer> or JSON text"),
    "bias": (_is_bias_map, "map<integer, number> or JSON text"),
}

def column_type(key: str) -> tuple[Callable[[pa.DataType], bool], str]:
    """(predicate on the column's Arrow type, what it expects in words) for sampling column `key`."""
    return _ACCEPTS[_kind(key)]


def _json(value: Any) -> Any:
    return parse_json(value) if isinstance(value, str) else value


def cell_value(key: str, value: Any) -> Any:
    """The `SamplingParams` value of `key` in a cell; ValueError when it cannot be one (range checks are
    `SamplingParams`' own)."""
    kind = _kind(key)
    if kind == "int" and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # integer columns read from float Parquet columns (pandas writes those)
    if kind in ("strings", "ints"):
        value = _json(value)
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected a list, got {type(value).__name__}")
        return tuple(value)
    if kind == "bias":
        value = _json(value)
        pairs = value.items() if isinstance(value, Mapping) else value  # Arrow maps read as (key, value) lists
        try:
            return {int(t): b for t, b in pairs}
        except (TypeError, ValueError):
            raise ValueError(f"expected a mapping of token id to bias, got {value!r}") from None
    return value
