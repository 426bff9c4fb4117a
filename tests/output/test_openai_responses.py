"""Batch API output lines from a request's rows: the bodies parse as the OpenAI SDK's own types."""

from __future__ import annotations

import pytest
from openai.types import BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from pipeline.output.openai_responses import request_hash, response_line
from pipeline.source.openai_batch import REQUEST_KEY

CHAT = {"object": "chat.completion", "top_logprobs": None}


def sample(index: int, **extra) -> dict:
    return {"id": "req-1", "sample_index": index, "text": f"out {index}", "token_ids": [5, 6],
            "logprobs": None, "logprob_tokens": None, "prompt_tokens": 7, "cached_tokens": 3,
            "completion_tokens": 2, "finish_reason": "stop", "error": None, **extra}


def test_a_chat_request_with_two_samples():
    rows = [sample(0, **{REQUEST_KEY: CHAT}), sample(1, finish_reason="incomplete", error="cut",
                                                     **{REQUEST_KEY: CHAT})]
    line = response_line(rows, "abc", "tiny", 1700000000, {"object": "text_completion"})
    assert line["id"] == "batch_req_abc" and line["custom_id"] == "req-1" and line["error"] is None
    assert line["response"]["status_code"] == 200 and line["response"]["request_id"] == "abc"
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert [c.message.content for c in body.choices] == ["out 0", "out 1"]
    assert [c.finish_reason for c in body.choices] == ["stop", "length"]  # a cut constrained output
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (7, 4, 11)
    assert body.usage.prompt_tokens_details.cached_tokens == 3 and body.model == "tiny"


def test_logprobs_of_chat_and_completion_requests():
    lp = {"logprobs": [{5: -0.1, 9: -2.5, 4: -3.0}, {6: -0.7, 1: -0.9}],
          "logprob_tokens": [{5: "He", 9: "A", 4: "x"}, {6: "llo", 1: "y"}]}
    chat = response_line([sample(0, **lp, **{REQUEST_KEY: {"object": "chat.completion", "top_logprobs": 1}})],
                         "r", "m", 0, {})
    content = ChatCompletion.model_validate(chat["response"]["body"]).choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("He", -0.1, [72, 101]), ("llo", -0.7, [108, 108, 111])]
    assert [[(a.token, a.logprob) for a in t.top_logprobs] for t in content] == [[("He", -0.1)], [("llo", -0.7)]]
    text = response_line([sample(0, **lp, **{REQUEST_KEY: {"object": "text_completion", "top_logprobs": 2}})],
                         "r", "m", 0, {})
    logprobs = Completion.model_validate(text["response"]["body"]).choices[0].logprobs
    assert logprobs.tokens == ["He", "llo"] and logprobs.token_logprobs == [-0.1, -0.7]
    assert logprobs.top_logprobs == [{"He": -0.1, "A": -2.5}, {"llo": -0.7, "y": -0.9}]
    assert logprobs.text_offset == [0, 2]


def test_rows_without_a_request_take_the_defaults():
    line = response_line([sample(0)], "r", "m", 0, {"object": "text_completion", "top_logprobs": None})
    body = Completion.model_validate(line["response"]["body"])
    assert body.object == "text_completion" and body.choices[0].text == "out 0" and body.id == "cmpl-r"


def test_an_embedding_request():
    row = {"id": "e1", "embedding": [0.5, -0.25], "prompt_tokens": 4, "cached_tokens": 0, "error": None}
    line = response_line([row], "r", "m", 0, {"object": "embedding"})
    body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
    assert body.data[0].embedding == [0.5, -0.25] and body.usage.prompt_tokens == 4 and line["error"] is None
    failed = response_line([{**row, "embedding": None, "error": "too long"}], "r", "m", 0, {"object": "embedding"})
    assert failed["response"] is None and failed["error"]["message"] == "too long"


@pytest.mark.parametrize("custom_id", ["req-1", None])
def test_a_failed_request_is_an_error_line(custom_id):
    rows = [sample(0, id=custom_id, text=None, finish_reason="error", error="line 3 of b.jsonl: no body")] * 2
    line = response_line(rows, "r", "m", 0, {})
    assert line == {"id": "batch_req_r", "custom_id": custom_id, "response": None,
                    "error": {"code": "invalid_request", "message": "line 3 of b.jsonl: no body"}}
    assert BatchError.model_validate(line["error"]).message.startswith("line 3")


def test_request_ids_are_stable_per_job_and_row():
    assert request_hash("fp", 3) == request_hash("fp", 3)
    assert len({request_hash("fp", 3), request_hash("fp", 4), request_hash("other", 3)}) == 3
