"""Whole runs on the tiny model through each input and output format: an OpenAI batch file answered line
for line in the Batch API's output format (parsed with the OpenAI SDK's types), JSON Lines in and out,
compressed input, and the formats crossed."""

from __future__ import annotations

import gzip
import io
import json
from collections import Counter

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai.types import BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.output.verify import verify_output
from tests.batch_requests import BAD, SCHEMA, read_lines, write_batch
from tests.test_config import compose_job

FAST = ("engine.kv_cache_memory=32MiB", "progress.mode=off", "model.quant=none", "engine.max_batch_size=64")


def run_job(tiny_model_dir, input_path, output_path, *overrides) -> dict:
    cfg = load_job_config(compose_job(f"input.path={input_path}", f"output.path={output_path}",
                                      f"model.path={tiny_model_dir}", *FAST, *overrides))
    return run(cfg, stdout=io.StringIO())


@pytest.fixture(scope="module")
def batch_output(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    batch = write_batch(tmp / "batch.jsonl")
    metrics = run_job(tiny_model_dir, batch, tmp / "out", "input.format=openai_batch", "output.rows_per_part=64")
    return tmp / "out", metrics


def test_an_openai_batch_file_gets_one_response_line_per_request(batch_output):
    out, metrics = batch_output
    lines = read_lines(str(out))
    assert len(lines) == 200 and metrics["rows"] == 200 and metrics["error_rows"] == len(BAD)
    # every custom_id once; the two lines that have none (not JSON, empty) are reported by line number
    want = Counter(f"req-{i}" for i in range(200) if i not in (17, 67)) + Counter({None: 2})
    assert Counter(line["custom_id"] for line in lines) == want
    assert len({line["id"] for line in lines}) == 200 and all(line["id"].startswith("batch_req_") for line in lines)
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"]}
    for i, (_, words) in BAD.items():
        line = by_id.get(f"req-{i}") or next(x for x in lines if x["custom_id"] is None and words in
                                             x["error"]["message"])
        assert line["response"] is None and words in BatchError.model_validate(line["error"]).message, (i, line)
    for i in (n for n in range(200) if n not in BAD):
        response = by_id[f"req-{i}"]["response"]
        assert by_id[f"req-{i}"]["error"] is None and response["status_code"] == 200
        if i % 10 == 1:  # a completion request: raw prompt, two alternatives per token
            body = Completion.model_validate(response["body"])
            choice = body.choices[0]
            assert body.object == "text_completion" and len(choice.logprobs.tokens) == body.usage.completion_tokens
            assert all(len(alternatives) == 2 for alternatives in choice.logprobs.top_logprobs)
            continue
        body = ChatCompletion.model_validate(response["body"])
        choice = body.choices[0]
        assert body.object == "chat.completion" and len(body.choices) == 1 and choice.message.role == "assistant"
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
        assert body.usage.completion_tokens <= (24 if i % 10 == 0 else 8)
        if i % 10 == 0 and choice.finish_reason == "stop":  # response_format: valid under the schema
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        if i % 10 == 3:
            assert [len(t.top_logprobs) for t in choice.logprobs.content] == [2] * body.usage.completion_tokens
        else:
            assert choice.logprobs is None
        if i % 10 == 4:
            assert body.usage.completion_tokens <= 6 and "." not in choice.message.content
    assert sum(by_id[f"req-{i}"]["response"]["body"]["choices"][0]["finish_reason"] == "stop"
               for i in range(0, 200, 10) if i not in BAD) >= 10  # most constrained outputs complete


def test_the_batch_output_verifies_and_a_rerun_has_nothing_to_do(batch_output, tiny_model_dir):
    out, _ = batch_output
    report = verify_output(str(out))
    assert report.ok and report.rows == 200, report.errors
    assert sorted(p.name for p in out.glob("part-*")) == [f"part-00000{i}.jsonl" for i in range(4)]
    metrics = run_job(tiny_model_dir, out.parent / "batch.jsonl", out, "input.format=openai_batch",
                      "output.rows_per_part=64")
    assert metrics["complete"] and metrics["rows"] == 0


def test_n_samples_per_request_are_its_choices(tiny_model_dir, tmp_path):
    lines = [{"custom_id": f"r{i}", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": f"Say {i}"}], **({"n": n} if n else {})}}
             for i, n in enumerate([None, 2, 1])]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_job(tiny_model_dir, tmp_path / "b.jsonl", tmp_path / "out", "input.format=openai_batch", "sampling.n=2",
            "sampling.temperature=0.9", "sampling.seed=5", "sampling.max_tokens=6")
    by_id = {line["custom_id"]: line for line in read_lines(str(tmp_path / "out"))}
    for custom_id in ("r0", "r1"):
        body = ChatCompletion.model_validate(by_id[custom_id]["response"]["body"])
        assert [c.index for c in body.choices] == [0, 1] and 2 <= body.usage.completion_tokens <= 12
    assert "n=1: this job writes sampling.n=2" in by_id["r2"]["error"]["message"]
    assert verify_output(str(tmp_path / "out")).ok


def test_embedding_requests_under_task_embed(tiny_model_dir, tmp_path):
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "text-embedding-3-small", "input": f"Sentence number {i}."}} for i in range(5)]
    lines.append({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": []}})
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_job(tiny_model_dir, tmp_path / "b.jsonl", tmp_path / "out", "input.format=openai_batch", "task=embed")
    by_id = {line["custom_id"]: line for line in read_lines(str(tmp_path / "out"))}
    for i in range(5):
        body = CreateEmbeddingResponse.model_validate(by_id[f"e{i}"]["response"]["body"])
        assert len(body.data) == 1 and len(body.data[0].embedding) == 128  # the tiny model's hidden size
        assert body.usage.prompt_tokens == body.usage.total_tokens > 0
    assert "/v1/chat/completions requests need task=generate; this job's task is embed" in by_id["c"]["error"][
        "message"]
    assert verify_output(str(tmp_path / "out")).ok


ROWS = [{"id": i, "prompt": f"Question number {i}: what comes next?", "topic": {"t": i % 3}} for i in range(9)]
STABLE = ("sample_index", "text", "prompt_tokens", "completion_tokens", "finish_reason", "error")


def test_jsonl_in_and_out_matches_parquet_in_and_out(tiny_model_dir, tmp_path):
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("id", "prompt")} for r in ROWS]),
                   tmp_path / "in.parquet")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    run_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "pq", "output.rows_per_part=4")
    run_job(tiny_model_dir, tmp_path / "in.jsonl", tmp_path / "js", "input.format=jsonl", "output.rows_per_part=4",
            "input.passthrough_columns=[topic]", "output.token_ids=true")
    run_job(tiny_model_dir, tmp_path / "in.jsonl.gz", tmp_path / "gz", "input.format=jsonl",
            "output.rows_per_part=4", "input.passthrough_columns=[topic]", "output.token_ids=true")
    reference = sorted(pq.read_table(tmp_path / "pq").to_pylist(), key=lambda r: r["id"])
    rows = sorted(read_lines(str(tmp_path / "js")), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(9))  # ids keep their JSON type
    assert [r["topic"] for r in rows] == [r["topic"] for r in ROWS]  # passthrough values as they were
    assert list(rows[0]) == ["id", "topic", "sample_index", "text", "token_ids", "prompt_tokens", "cached_tokens",
                             "completion_tokens", "finish_reason", "error"]  # the Parquet output's columns
    assert [[r[k] for k in STABLE] for r in rows] == [[r[k] for k in STABLE] for r in reference]
    assert sorted(read_lines(str(tmp_path / "gz")), key=lambda r: r["id"]) == rows  # gzip reads the same rows
    assert verify_output(str(tmp_path / "js")).ok and verify_output(str(tmp_path / "gz")).ok


def test_formats_crossed(tiny_model_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + '{"prompt": "no id"}\n[]\n')
    run_job(tiny_model_dir, tmp_path / "in.jsonl", tmp_path / "pq", "input.format=jsonl", "output.format=parquet",
            "input.passthrough_columns=[topic]")
    table = pq.read_table(tmp_path / "pq")
    assert table.schema.field("id").type == pa.string() and table.schema.field("topic").type == pa.string()
    rows = sorted(table.to_pylist(), key=lambda r: r["id"])
    assert [r["id"] for r in rows] == [*map(str, range(9)), "in.jsonl:10", "in.jsonl:9"]  # JSON values as text
    assert rows[0]["topic"] == '{"t": 0}' and rows[-1]["error"] is None  # `in.jsonl:9`: a line without an id
    assert rows[-2]["error"] == "line 11 of in.jsonl: not a JSON object (a JSON list)"
    assert verify_output(str(tmp_path / "pq")).ok

    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in ("id", "prompt")} for r in ROWS]), tmp_path / "in.parquet")
    run_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "oa", "output.format=openai_batch",
            "sampling.logprobs=1")
    lines = sorted(read_lines(str(tmp_path / "oa")), key=lambda line: line["custom_id"])
    assert [line["custom_id"] for line in lines] == list(range(9))
    body = ChatCompletion.model_validate(lines[0]["response"]["body"])  # rendered with the chat template
    assert body.object == "chat.completion" and len(body.choices[0].logprobs.content[0].top_logprobs) == 1
    assert verify_output(str(tmp_path / "oa")).ok
