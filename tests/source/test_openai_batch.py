"""OpenAI Batch API request lines -> rows: bodies onto the per-row sampling keys, error rows for lines that
cannot run, and the prompt each kind of request gets (chat template or raw text)."""

from __future__ import annotations

import json

import pytest

from pipeline.config import InputConfig
from pipeline.engine.request import SamplingParams
from pipeline.model.tokenizer import Tokenizer
from pipeline.source.files import BAD_CELLS
from pipeline.source.openai_batch import (
    REQUEST_KEY,
    OpenAIBatchSource,
    RequestError,
    RequestPromptBuilder,
    request_row,
)

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}}, "required": ["label"]}


def chat(body: dict, custom_id: str = "r1", url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_a_chat_body_maps_onto_the_sampling_keys():
    row = request_row(chat({
        "model": "gpt-4o-mini", "messages": [{"role": "developer", "content": "Be brief."},
                                             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                                          {"type": "text", "text": "there"}]}],
        "max_tokens": 9, "max_completion_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "###",
        "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.1, "logit_bias": {"50": -100}, "top_k": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
        "user": "u", "n": 1, "service_tier": None}), "generate", 1)
    assert row == {
        "custom_id": "r1",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}],
        "max_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["###"], "logprobs": 2,
        "presence_penalty": 0.1, "logit_bias": {"50": -100}, "top_k": 5, "json_schema": json.dumps(SCHEMA),
        REQUEST_KEY: {"object": "chat.completion", "top_logprobs": 2},
    }


def test_a_completion_body_and_defaults():
    row = request_row(chat({"prompt": ["Once upon"], "max_tokens": 4, "logprobs": 0}, url="/v1/completions"),
                      "generate", 1)
    assert row == {"custom_id": "r1", "prompt": "Once upon", "max_tokens": 4, "logprobs": 1,
                   REQUEST_KEY: {"object": "text_completion", "top_logprobs": 0}}
    bare = request_row(chat({"messages": [{"role": "user", "content": "x"}]}), "generate", 2)
    assert bare["max_tokens"] is None and "logprobs" not in bare  # the job's sampling.* values
    assert request_row(chat({"messages": [], "response_format": {"type": "json_object"}}), "generate", 1)[
        "json_schema"] == '{"type": "object"}'


def test_an_embedding_body_under_task_embed():
    row = request_row(chat({"input": ["some text"], "model": "text-embedding-3-small", "encoding_format": "float"},
                           url="/v1/embeddings"), "embed", 1)
    assert row == {"custom_id": "r1", "prompt": "some text", REQUEST_KEY: {"object": "embedding", "top_logprobs": None}}
    with pytest.raises(RequestError, match="/v1/chat/completions requests need task=generate; this job's task is embed"):
        request_row(chat({"messages": []}), "embed", 1)
    with pytest.raises(RequestError, match="body.temperature is not supported"):
        request_row(chat({"input": "x", "temperature": 1}, url="/v1/embeddings"), "embed", 1)
    with pytest.raises(RequestError, match="encoding_format 'base64'"):
        request_row(chat({"input": "x", "encoding_format": "base64"}, url="/v1/embeddings"), "embed", 1)


@pytest.mark.parametrize("line, words", [
    (chat({}, url="/v1/images"), "url '/v1/images' is not one of"),
    ({**chat({}), "method": "GET"}, "method 'GET' is not POST"),
    ({"url": "/v1/chat/completions", "body": {}}, "custom_id is missing"),
    (chat({"input": "x"}, url="/v1/embeddings"), "/v1/embeddings requests need task=embed; this job's task is generate"),
    ({"custom_id": "a", "url": "/v1/chat/completions"}, "no body"),
    (chat([1]), "body is not a JSON object"),  # type: ignore[arg-type]
    (chat({"messages": [], "tools": [{"type": "function"}]}), "body.tools is not supported"),
    (chat({"messages": [], "n": 3}), "n=3: this job writes sampling.n=1 samples per request"),
    (chat({"messages": "hi"}), "body.messages must be a list"),
    (chat({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), "content part 'image_url'"),
    (chat({"prompt": ["a", "b"]}, url="/v1/completions"), "body.prompt must be one text"),
    (chat({"messages": [], "logprobs": True, "top_logprobs": -1}), "body.top_logprobs must be an integer >= 0"),
    (chat({"messages": [], "response_format": {"type": "grammar"}}), "response_format.type 'grammar'"),
    (chat({"messages": [], "response_format": {"type": "json_schema", "json_schema": {}}}), "schema must be"),
])
def test_lines_that_cannot_run(line, words):
    with pytest.raises(RequestError, match=words):
        request_row(line, "generate", 1)


def test_source_rows_name_the_bad_line(tmp_path):
    lines = [json.dumps(chat({"messages": [{"role": "user", "content": "ok"}]}, "a")), "{broken",
             json.dumps({"custom_id": "c", "url": "/v1/chat/completions"}), ""]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    source = OpenAIBatchSource(str(tmp_path / "batch.jsonl"), "generate", 1)
    assert source.total_rows == 4
    rows = [r for f, start, b in source.batches([], 2) for r in source.rows(f, start, b)]
    assert rows[0]["custom_id"] == "a" and BAD_CELLS not in rows[0]
    assert rows[1]["custom_id"] is None and rows[1][BAD_CELLS][0].startswith("line 2 of batch.jsonl: not valid JSON")
    assert rows[2] == {"custom_id": "c", BAD_CELLS: ["line 3 of batch.jsonl: no body"]}
    assert rows[3][BAD_CELLS] == ["line 4 of batch.jsonl: empty line"]
    assert source.id_field("id", {}) == ("custom_id", source.check_columns([])["custom_id"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_hf_dir(tiny_model_dir)


def test_chat_requests_render_the_template_and_completions_stay_raw(tokenizer):
    builder = RequestPromptBuilder(tokenizer, InputConfig(system_prompt="S"), SamplingParams(max_tokens=8), 2048)
    messages = [{"role": "user", "content": "Hi"}]
    chat_row = request_row(chat({"messages": messages, "max_completion_tokens": 5, "seed": 4, "temperature": 1.0}),
                           "generate", 1)
    prepared = builder.prepare(chat_row)
    assert prepared.token_ids == tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, *messages]))
    assert prepared.sampling == SamplingParams(max_tokens=5, seed=4, temperature=1.0)
    assert builder.seeded(prepared, "r1").seed == 4  # the request's own seed
    text = builder.prepare(request_row(chat({"prompt": "Once upon a time", "stop": ["."]}, url="/v1/completions"),
                                       "generate", 1))
    assert text.token_ids == tokenizer.encode("Once upon a time")  # no template, no system prompt
    assert text.sampling == SamplingParams(max_tokens=8, stop=(".",))
    embedding = builder.prepare(request_row(chat({"input": "Once upon a time"}, url="/v1/embeddings"), "embed", 1))
    assert embedding.token_ids == text.token_ids
    bad = builder.prepare({"custom_id": None, BAD_CELLS: ["line 2 of b.jsonl: not valid JSON"]})
    assert bad.error == "line 2 of b.jsonl: not valid JSON"
    wrong = builder.prepare(request_row(chat({"messages": messages, "temperature": -1}), "generate", 1))
    assert "temperature" in wrong.error
