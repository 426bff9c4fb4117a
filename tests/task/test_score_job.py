"""task=score on the tiny random model (in-process `pipeline.job.run`), against transformers in float32."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_job_config
from pipeline.job import run
from pipeline.model.loader import load_model
from tests.task.reference import reference_logprobs
from tests.test_config import compose_job

PROMPT = "Question: what colour is the sky on a clear day?"
CANDIDATES = [" blue", " blue sky", " green", " a deep shade of red"]  # two share a prefix, two do not
FAST = ("engine.kv_cache_memory=16MiB", "progress.mode=off", "model.quant=none", "task=score")


def score_job(model_dir, inp, out, *overrides):
    return load_job_config(compose_job(f"input.path={inp}", f"output.path={out}", f"model.path={model_dir}", *FAST,
                                       *overrides))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_model(tiny_model_dir).tokenizer


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_scores_match_transformers_and_shared_prompts_are_computed_once(tmp_path, tiny_model_dir, tiny_reference,
                                                                          tokenizer):
    """Rows with the same prompt and overlapping candidates: each candidate's log-probabilities are
    transformers' (chat-templated prompt, then the candidate encoded on its own); the prompt's full blocks are
    computed by the first candidate only, and the next row's candidates all find them cached."""
    rows = [{"id": 0, "prompt": PROMPT, "candidates": CANDIDATES, "topic": "sky"},
            {"id": 1, "prompt": PROMPT, "candidates": CANDIDATES[::-1], "topic": "sky"},
            {"id": 2, "prompt": "Name a fruit.", "candidates": [" apple", " pear"], "topic": "food"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    metrics = run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "input.passthrough_columns=[topic]",
                            "engine.block_size=16"), stdout=io.StringIO())
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("scores").type == pa.list_(pa.struct(
        [("logprob_sum", pa.float64()), ("logprob_mean", pa.float64()), ("num_tokens", pa.int32())]))
    assert table.schema.field("best_candidate").type == pa.int32()
    assert table.column_names == ["id", "topic", "scores", "best_candidate", "prompt_tokens", "cached_tokens", "error"]
    out = {r["id"]: r for r in table.to_pylist()}
    assert metrics["task"] == "score" and metrics["rows"] == 3 and metrics["error_rows"] == 0
    for row in rows:
        got = out[row["id"]]
        prompt = chat_prompt(tokenizer, row["prompt"])
        assert got["error"] is None and got["topic"] == row["topic"] and got["prompt_tokens"] == len(prompt)
        sums = []
        for score, text in zip(got["scores"], row["candidates"], strict=True):
            want = reference_logprobs(tiny_reference, prompt, tokenizer.encode(text))
            assert score["num_tokens"] == len(want)
            assert score["logprob_sum"] == pytest.approx(sum(want), abs=1e-4 * len(want))
            assert score["logprob_mean"] == pytest.approx(score["logprob_sum"] / len(want))
            sums.append(sum(want))
        assert got["best_candidate"] == max(range(len(sums)), key=sums.__getitem__)
    shared = (len(chat_prompt(tokenizer, PROMPT)) - 1) // 16 * 16  # the prompt's blocks a candidate may reuse
    assert shared >= 16
    assert out[0]["cached_tokens"] >= (len(CANDIDATES) - 1) * shared
    assert out[1]["cached_tokens"] >= len(CANDIDATES) * shared
    assert metrics["cached_tokens"] == sum(r["cached_tokens"] for r in out.values())
    assert metrics["generated_tokens"] == 0


def test_per_token_logprobs_and_a_single_string_candidate(tmp_path, tiny_model_dir, tiny_reference, tokenizer):
    """A string column (one candidate per row), raw prompts, sampling.logprobs=2: each token's top-2 and its own."""
    pq.write_table(pa.table({"prompt": ["The sky is", "Apples are"], "candidates": [" blue", " red or green"]}),
                   tmp_path / "in.parquet")
    run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "input.chat_template=false",
                  "sampling.logprobs=2"), stdout=io.StringIO())
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("scores").type.value_type.field("logprobs").type == pa.list_(
        pa.map_(pa.int32(), pa.float32()))
    for got in table.to_pylist():
        prompt = tokenizer.encode({"in.parquet:0": "The sky is", "in.parquet:1": "Apples are"}[got["id"]])
        candidate = tokenizer.encode({"in.parquet:0": " blue", "in.parquet:1": " red or green"}[got["id"]])
        want = reference_logprobs(tiny_reference, prompt, candidate)
        (score,) = got["scores"]
        assert got["best_candidate"] == 0 and len(score["logprobs"]) == len(candidate)
        for entry, token, value in zip(score["logprobs"], candidate, want):
            entry = dict(entry)
            assert entry[token] == pytest.approx(value, abs=1e-4) and 2 <= len(entry) <= 3


def test_rows_without_scorable_candidates_are_error_rows(tmp_path, tiny_model_dir):
    rows = [{"id": 0, "prompt": "Pick one.", "candidates": [" yes", " no"]},
            {"id": 1, "prompt": "Pick one.", "candidates": None},
            {"id": 2, "prompt": "Pick one.", "candidates": []},
            {"id": 3, "prompt": "Pick one.", "candidates": [" yes", None]},
            {"id": 4, "prompt": "Pick one.", "candidates": ["", " no"]},
            {"id": 5, "prompt": None, "candidates": [" yes"]},
            {"id": 6, "prompt": "Pick one.", "candidates": [" maybe"]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    metrics = run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), stdout=io.StringIO())
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert (metrics["rows"], metrics["error_rows"]) == (7, 5)
    assert {i: out[i]["error"] for i in range(1, 6)} == {
        1: "candidates are null (column 'candidates')",
        2: "no candidates: column 'candidates' holds an empty list",
        3: "candidate 1 is not text: NoneType",
        4: "candidate 0 encodes to no tokens",
        5: "prompt is null (column 'prompt')",
    }
    for i in range(1, 6):
        assert out[i]["scores"] is None and out[i]["best_candidate"] is None
    assert out[0]["error"] is None and len(out[0]["scores"]) == 2 and out[6]["best_candidate"] == 0


def test_a_candidate_past_max_model_len_makes_its_row_an_error_row(tmp_path, tiny_model_dir):
    """The prompt keeps room for the longest candidate: cut on the left with input.truncate=left, else the row
    is an error row naming both lengths."""
    long_prompt = " ".join(["word"] * 40)
    pq.write_table(pa.table({"id": [0, 1], "prompt": [long_prompt, "Short."], "candidates": [[" a", " b"], [" c"]]}),
                   tmp_path / "in.parquet")
    run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out", "engine.max_model_len=24",
                  "input.chat_template=false"), stdout=io.StringIO())
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert out[0]["error"].startswith("prompt has 40 tokens; max_model_len=24 - the longest candidate's 1 allows 23")
    assert out[1]["error"] is None
    run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "left", "engine.max_model_len=24",
                  "input.chat_template=false", "input.truncate=left"), stdout=io.StringIO())
    out = {r["id"]: r for r in pq.read_table(tmp_path / "left").to_pylist()}
    assert out[0]["error"] is None and out[0]["prompt_tokens"] == 23


def test_a_candidates_column_of_another_type_stops_the_job(tmp_path, tiny_model_dir):
    from pipeline.errors import JobError

    pq.write_table(pa.table({"prompt": ["x"], "candidates": [[1, 2]]}), tmp_path / "in.parquet")
    with pytest.raises(JobError, match=r"column 'candidates' \(input.candidates_column\) has type list<\w+: int64>, "
                                       r"expected string or list<string>"):
        run(score_job(tiny_model_dir, tmp_path / "in.parquet", tmp_path / "out"), stdout=io.StringIO())
    assert not (tmp_path / "out").exists()


def test_json_lines_candidates_of_any_json_type(tmp_path, tiny_model_dir):
    """JSON Lines rows carry any JSON value: a candidate that is a number or an object makes its row an error
    row; a plain string is one candidate."""
    lines = [{"id": "a", "prompt": "Pick one.", "candidates": [" yes", 3]},
             {"id": "b", "prompt": "Pick one.", "candidates": {"text": " yes"}},
             {"id": "c", "prompt": "Pick one.", "candidates": " yes"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run(score_job(tiny_model_dir, tmp_path / "in.jsonl", tmp_path / "out", "input.format=jsonl",
                  "output.format=parquet"), stdout=io.StringIO())
    out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert out["a"]["error"] == "candidate 1 is not text: int"
    assert out["b"]["error"] == "candidates must be a string or a list of strings, got dict (column 'candidates')"
    assert out["c"]["error"] is None and len(out["c"]["scores"]) == 1
