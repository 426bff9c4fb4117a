"""JSON Lines parts: records round-trip, token maps keep integer ids, odd characters stay in their line."""

from __future__ import annotations

import datetime

from pipeline.output.jsonl_rows import decode, encode


def test_records_round_trip():
    rows = [{"id": 1, "text": "a\u2028b\nc \u00e9", "logprobs": [{5: -0.5, 17: -1.0}, None],
             "logprob_tokens": [{5: "x"}], "prompt_logprobs": None, "error": None},
            {"id": "two", "text": None, "logprobs": None, "logprob_tokens": None, "prompt_logprobs": [None, {3: -2.0}],
             "error": "why"}]
    data = encode(rows)
    assert data.count(b"\n") == 2 and "\u00e9".encode() in data  # UTF-8, one line per record
    assert decode(data) == rows
    assert decode(data, ["id", "error"]) == [{"id": 1, "error": None}, {"id": "two", "error": "why"}]


def test_values_json_lacks_are_written_as_text():
    assert decode(encode([{"id": datetime.date(2024, 5, 1)}])) == [{"id": "2024-05-01"}]
