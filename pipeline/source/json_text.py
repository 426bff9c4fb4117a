"""JSON text in input cells and lines, parsed with a reason a user can act on when it is not JSON."""

from __future__ import annotations

import json
from typing import Any


def parse_json(text: str | bytes) -> Any:
    """`json.loads(text)`; ValueError saying where the text stops being JSON, or that it nests too deeply for
    Python (a RecursionError that must not escape as a crash of the whole job)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at char {e.pos})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
