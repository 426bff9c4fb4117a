"""One OpenAI Batch API output line per request, made from the request's output rows (one per sample).

A request that ran is `{"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
"request_id": ..., "body": ...}, "error": null}`, its body a `chat.completion` or `text_completion` object
whose choices are the request's samples, or an embedding `list` (task=embed); one whose row failed is `{"id": ..., "custom_id": ...,
"response": null, "error": {"code": "invalid_request", "message": ...}}`. Ids are derived from the job's
fingerprint and the input row, so a resumed run writes the same ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.source.openai_batch import REQUEST_KEY

# The pipeline's finish reasons in the API's words: a constrained output cut by max_tokens is `length`.
FINISH_REASONS = {"stop": "stop", "length": "length", "incomplete": "length"}
ERROR_CODE = "invalid_request"


def request_hash(fingerprint: str, input_row: int) -> str:
    """A stable id for one request of one job."""
    return hashlib.sha256(f"{fingerprint}:{input_row}".encode()).hexdigest()[:32]


def response_line(samples: Sequence[Mapping[str, Any]], request_id: str, model: str, created: int,
                  defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The output line of one request from its rows (sample 0, 1, ...). `defaults`: how to answer a row
    that does not say (a row from a Parquet or JSON Lines input): `object` and `top_logprobs`."""
    first = samples[0]
    line: dict[str, Any] = {"id": f"batch_req_{request_id}", "custom_id": first["id"]}
    # a failed row (an error that is not an `incomplete` constrained output's note)
    failed = next((r for r in samples if r["error"] is not None and r.get("finish_reason", "error") == "error"),
                  None)
    if failed is not None:
        return {**line, "response": None, "error": {"code": ERROR_CODE, "message": failed["error"]}}
    request = {**defaults, **(first.get(REQUEST_KEY) or {})}
    if request["object"] == "embedding":
        return {**line, "response": {"status_code": 200, "request_id": request_id,
                                     "body": _embeddings(first, model)}, "error": None}
    chat = request["object"] == "chat.completion"
    top = request.get("top_logprobs")
    completion = sum(r["completion_tokens"] for r in samples)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
        "object": request["object"],
        "created": created,
        "model": model,
        "choices": [(_chat_choice if chat else _text_choice)(r, top) for r in samples],
        "usage": {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
                  "total_tokens": first["prompt_tokens"] + completion,
                  "prompt_tokens_details": {"cached_tokens": first["cached_tokens"]}},
    }
    return {**line, "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def _embeddings(row: Mapping[str, Any], model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
            "model": model, "usage": {"prompt_tokens": row["prompt_tokens"], "total_tokens": row["prompt_tokens"]}}


def _chat_choice(row: Mapping[str, Any], top: int | None) -> dict[str, Any]:
    return {"index": row["sample_index"], "message": {"role": "assistant", "content": row["text"], "refusal": None},
            "logprobs": _chat_logprobs(row, top), "finish_reason": FINISH_REASONS[row["finish_reason"]]}


def _text_choice(row: Mapping[str, Any], top: int | None) -> dict[str, Any]:
    return {"index": row["sample_index"], "text": row["text"], "logprobs": _text_logprobs(row, top),
            "finish_reason": FINISH_REASONS[row["finish_reason"]]}


def _tokens(row: Mapping[str, Any], top: int | None) -> list[tuple[str, float, list[tuple[str, float]]]] | None:
    """(text, log-probability, the top `top` alternatives as (text, log-probability)) of each generated
    token, or None when the request did not ask for them."""
    if top is None or row.get("logprobs") is None:
        return None
    out = []
    for token, entry, texts in zip(row["token_ids"], row["logprobs"], row["logprob_tokens"]):
        best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
        out.append((texts[token], entry[token], [(texts[t], lp) for t, lp in best]))
    return out


def _chat_logprobs(row: Mapping[str, Any], top: int | None) -> dict[str, Any] | None:
    tokens = _tokens(row, top)
    if tokens is None:
        return None

    def token(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**token(text, lp), "top_logprobs": [token(t, p) for t, p in best]}
                        for text, lp, best in tokens], "refusal": None}


def _text_logprobs(row: Mapping[str, Any], top: int | None) -> dict[str, Any] | None:
    tokens = _tokens(row, top)
    if tokens is None:
        return None
    offsets, at = [], 0
    for text, _, _ in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": [t for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens],
            "top_logprobs": [dict(best) for _, _, best in tokens], "text_offset": offsets}
