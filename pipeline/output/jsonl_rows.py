"""JSON Lines part files: one JSON object per line, encoded and decoded.

Why a module of its own: the sinks write these parts and the ledger reads them back (`verify`, a resume
that retries error rows), and neither should import the other. JSON object keys are strings, so the
per-token maps (token id -> log-probability or text) come back with their ids as integers again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Columns holding a list of {token id: value} maps (pipeline/output/sink.py's result_schema).
TOKEN_MAP_COLUMNS = ("logprobs", "logprob_tokens", "prompt_logprobs")


def encode(records: Iterable[Mapping[str, Any]]) -> bytes:
    """One compact JSON line per record, UTF-8; values JSON lacks (dates, decimals, bytes) as their str."""
    return "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records).encode()


def decode(data: bytes, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The records of a part (only `columns`, when given), token maps keyed by integers again."""
    out = []
    for line in data.split(b"\n")[:-1]:  # every record ends with a newline (str.splitlines would also cut
        record = json.loads(line)            # at the U+2028 a text may hold)
        if columns is not None:
            record = {c: record.get(c) for c in columns}
        for column in TOKEN_MAP_COLUMNS:
            if isinstance(record.get(column), list):
                record[column] = [None if m is None else {int(k): v for k, v in m.items()} for m in record[column]]
        out.append(record)
    return out
