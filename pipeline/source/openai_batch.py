"""OpenAI Batch API input files: one request per line, mapped onto the job's rows and per-row sampling.

A line is `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" |
"/v1/embeddings", "body": {...}}`. Its body becomes a row that the job's own machinery runs: `messages`
rendered with the chat template (chat requests) or `prompt` as raw text (completion requests, and an
embedding request's `input`, under `task=embed`, as those endpoints do), and the
body's sampling values under the engine's names, read as per-row sampling columns are
(pipeline/source/sampling_columns.py): `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`,
`seed`, `stop`, `logprobs` / `top_logprobs`, `response_format` (a JSON schema constraint), penalties,
`logit_bias`, and vLLM's extensions with the engine's names (`top_k`, `min_p`, ...). A body value left out
takes the job's `sampling.*` value. `n` must be the job's `sampling.n`: the samples per row are fixed for
the whole output. A line that cannot run (not JSON, no body, an unknown url or body field, a url of another
task) becomes an error row for its custom_id, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from pipeline.config import InputConfig
from pipeline.engine.request import SamplingParams
from pipeline.errors import JobError
from pipeline.source.files import BAD_CELLS, ColumnSpec, SourceFile
from pipeline.source.jsonl import JsonlSource, LineError, parse_line
from pipeline.source.prompts import ChatTokenizer, Prepared, PromptBuilder

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URL_TASKS = {CHAT: "generate", COMPLETIONS: "generate", EMBEDDINGS: "embed"}
ID_KEY = "custom_id"
# The row key that tells the output how to answer the request: {"object": "chat.completion" |
# "text_completion" | "embedding", "top_logprobs": k or None}. The job carries it to the request's output rows.
REQUEST_KEY = "openai_request"
# Body keys read as the engine's sampling keys of the same name: OpenAI's, and vLLM's extensions.
SAMPLING_KEYS = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                 "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")
# Every per-row sampling key a request row may carry.
ROW_SAMPLING = (*SAMPLING_KEYS, "max_tokens", "logprobs", "json_schema")
# Body keys that change nothing here: the job's model answers every request, and the output is a file.
_IGNORED = ("model", "user", "store", "metadata", "service_tier", "stream", "stream_options")
_BODY_KEYS = {
    CHAT: {"messages", "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "response_format",
           *SAMPLING_KEYS},
    COMPLETIONS: {"prompt", "max_tokens", "n", "logprobs", *SAMPLING_KEYS},
    EMBEDDINGS: {"input", "encoding_format"},
}
_ROLES = {"developer": "system"}  # OpenAI's newer name for the system turn


class RequestError(ValueError):
    """Why a request line cannot run (its row's error)."""


def request_row(line: Mapping[str, Any], task: str, samples: int) -> dict[str, Any]:
    """The row of one request line: `custom_id`, `messages` or `prompt`, sampling values by the engine's
    names, and REQUEST_KEY. RequestError when the line cannot run; `samples`: the job's `sampling.n`."""
    url = line.get("url")
    if url not in URL_TASKS:
        raise RequestError(f"url {url!r} is not one of {', '.join(URL_TASKS)}")
    if line.get("method", "POST") != "POST":
        raise RequestError(f"method {line.get('method')!r} is not POST")
    if not isinstance(line.get(ID_KEY), str):
        raise RequestError("custom_id is missing or not a string")
    if URL_TASKS[url] != task:
        raise RequestError(f"{url} requests need task={URL_TASKS[url]}; this job's task is {task}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise RequestError("no body" if body is None else "body is not a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # null means "the default", as in the API
    unknown = sorted(k for k in body if k not in _BODY_KEYS[url] and k not in _IGNORED)
    if unknown:
        raise RequestError(f"body.{unknown[0]} is not supported")
    if body.get("n", samples) != samples:
        raise RequestError(f"n={body['n']}: this job writes sampling.n={samples} samples per request (run "
                           f"requests with n={body['n']} as a job with sampling.n={body['n']})")
    row: dict[str, Any] = {ID_KEY: line[ID_KEY], **{k: body[k] for k in SAMPLING_KEYS if k in body}}
    if isinstance(row.get("stop"), str):
        row["stop"] = [row["stop"]]
    if url == CHAT:
        row["messages"] = _messages(body.get("messages"))
        row["max_tokens"] = body.get("max_completion_tokens", body.get("max_tokens"))
        top = _count(body, "top_logprobs") if body.get("logprobs") else None
        if "response_format" in body:
            row["json_schema"] = _json_schema(body["response_format"])
        kind = "chat.completion"
    elif url == COMPLETIONS:
        row["prompt"] = _prompt(body, "prompt")
        row["max_tokens"] = body.get("max_tokens")
        top = _count(body, "logprobs") if "logprobs" in body else None
        kind = "text_completion"
    else:
        if body.get("encoding_format", "float") != "float":
            raise RequestError(f"body.encoding_format {body['encoding_format']!r} is not supported (float only)")
        row["prompt"] = _prompt(body, "input")
        top, kind = None, "embedding"
    if top is not None:  # the engine reports the chosen token's log-probability with its top k (k >= 1)
        row["logprobs"] = max(top, 1)
    row[REQUEST_KEY] = {"object": kind, "top_logprobs": top}
    return row


def _count(body: Mapping[str, Any], key: str) -> int:
    value = body.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"body.{key} must be an integer >= 0, got {value!r}")
    return value


def _messages(value: Any) -> list[Any]:
    """The chat messages with text content parts joined and `developer` read as `system`; the prompt
    builder checks the rest (roles, content) as it does for a messages column."""
    if not isinstance(value, list):
        raise RequestError("body.messages must be a list of messages")
    out = []
    for i, message in enumerate(value):
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                content = "\n".join(_text_part(i, part) for part in content)
            message = {"role": _ROLES.get(message.get("role"), message.get("role")), "content": content}
        out.append(message)
    return out


def _text_part(i: int, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise RequestError(f"message {i}: content part {kind!r} is not supported (text parts only)")
    return part["text"]


def _prompt(body: Mapping[str, Any], key: str) -> Any:
    """The body's one text prompt under `key` (a list of one string is that string)."""
    value = body.get(key)
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], str):
            raise RequestError(f"body.{key} must be one text (a string, or a list of one string)")
        return value[0]
    return value


def _json_schema(value: Any) -> str | None:
    """The JSON schema constraint of a `response_format`, as JSON text (None for plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise RequestError("body.response_format.json_schema.schema must be a JSON Schema object")
        return json.dumps(schema)
    raise RequestError(f"body.response_format.type {kind!r} is not one of text, json_object, json_schema")


class OpenAIBatchSource(JsonlSource):
    """OpenAI batch input files: JSON Lines whose lines are requests (`request_row`)."""

    carried = (REQUEST_KEY,)

    def __init__(self, path: str | Sequence[str], task: str, samples: int, text_columns: Sequence[str] = (),
                 storage_options: dict | None = None) -> None:
        super().__init__(path, ID_KEY, text_columns, storage_options)
        self.task = task
        self.samples = samples

    def check_columns(self, specs: Sequence[ColumnSpec]) -> dict[str, pa.DataType]:
        """The columns of a request row, whatever the config names (requests name their own fields)."""
        if any(spec.key == "input.passthrough_columns" for spec in specs):
            raise JobError("input.passthrough_columns does not apply to input.format=openai_batch: a request "
                           "line's fields are the request's")
        return {ID_KEY: pa.string(), "messages": pa.string(), "prompt": pa.string(),
                **{k: pa.string() for k in ROW_SAMPLING}}

    def id_field(self, column: str, types: dict[str, pa.DataType]) -> tuple[str, pa.DataType] | None:
        return ID_KEY, pa.string()

    def row(self, file: SourceFile, index: int, raw: bytes) -> dict:
        line: Any = None
        try:
            line = parse_line(raw)
            return request_row(line, self.task, self.samples)
        except (LineError, RequestError) as e:
            custom_id = line.get(ID_KEY) if isinstance(line, dict) else None
            return {ID_KEY: custom_id, BAD_CELLS: [f"line {index + 1} of {file.name}: {e}"]}


class RequestPromptBuilder:
    """The prompt builder of request rows: a chat request's messages rendered with the chat template, a
    completion request's prompt and an embedding request's input as raw text (what each endpoint does), with
    the request's sampling values."""

    def __init__(self, tokenizer: ChatTokenizer, inp: InputConfig, sampling: SamplingParams,
                 max_model_len: int, job_seed: int = 0) -> None:
        columns = list(ROW_SAMPLING)
        chat = dataclasses.replace(inp, messages_column="messages", sampling_columns=columns)
        text = dataclasses.replace(inp, messages_column=None, prompt_column="prompt", chat_template=False,
                                   system_prompt=None, sampling_columns=columns)
        self.chat = PromptBuilder(tokenizer, chat, sampling, max_model_len, job_seed)
        self.text = PromptBuilder(tokenizer, text, sampling, max_model_len, job_seed)

    def prepare(self, row: Mapping[str, Any]) -> Prepared:
        request = row.get(REQUEST_KEY) or {}
        return (self.chat if request.get("object") == "chat.completion" else self.text).prepare(row)

    def seeded(self, prepared: Prepared, row_id: Any) -> SamplingParams:
        return self.chat.seeded(prepared, row_id)  # both builders seed alike
