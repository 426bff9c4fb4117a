"""Bad input: each case ends in a clear job-level error naming the file, column or key (before the model
loads), or in error rows; never in lost or duplicated rows."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output, write_prompts

pytestmark = pytest.mark.slow


def ok_rows(n: int, start: int = 0) -> list[dict]:
    return [{"id": start + i, "prompt": f"Say something about {i}."} for i in range(n)]


def run_ok(job_runner, inp, out, model_dir, *extra: str) -> list[dict]:
    """Run a job over `inp` into `out` with the tiny model; it must succeed. Returns the output rows."""
    rc, log = job_runner.run([f"input.path={inp}", f"output.path={out}", f"model.path={model_dir}", *extra,
                              "engine.kv_cache_memory=32MiB", "progress.mode=off", "model.quant=none"])
    assert rc == 0, log
    return read_output(str(out))


def setup_case(case: str, tmp_path, model_dir) -> tuple[list[str], int, str]:
    """Arguments for one bad-input case, the expected exit status, and text the error must contain."""
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    good = write_prompts(inp / "a.parquet", ok_rows(4))
    base = [f"input.path={inp}", f"output.path={out}", f"model.path={model_dir}", "progress.mode=off", "model.quant=none"]
    if case == "empty input folder":
        good.unlink()
        return base, 2, "is a directory with no .parquet files"
    if case == "glob matching nothing":
        return [*base, f"input.path={inp}/*.nothing"], 2, "matches no files"
    if case == "non-parquet file":
        (inp / "b.parquet").write_text("id,prompt\n1,hello\n")
        return base, 2, "cannot read Parquet file b.parquet"
    if case == "truncated parquet":
        data = good.read_bytes()
        (inp / "b.parquet").write_bytes(data[: len(data) // 2])
        return base, 2, "cannot read Parquet file b.parquet"
    if case == "missing prompt column":
        write_prompts(inp / "b.parquet", [{"id": 9, "question": "hi"}])
        return base, 2, "b.parquet: no column 'prompt' (set by input.prompt_column); available columns: id, question"
    if case == "mistyped prompt column":
        write_prompts(inp / "b.parquet", [{"id": 9, "prompt": 5}])
        return base, 2, "b.parquet: column 'prompt' (input.prompt_column) has type int64, expected string"
    if case == "id column in some files only":
        write_prompts(inp / "b.parquet", [{"prompt": "hi"}])
        return base, 2, "b.parquet: no id column 'id'"
    if case == "invalid sampling value":
        return [*base, "sampling.temperature=-1"], 2, "temperature must be a finite number >= 0"
    if case == "unknown config key":
        return [*base, "input.nonsense=1"], 1, "Could not override 'input.nonsense'"
    if case == "missing model file":
        return [*base, f"model.path={tmp_path}/nope.gguf"], 2, "model file not found"
    if case == "output path is a file":
        out.write_text("x")
        return base, 2, f"output.path {out} is a file"
    if case == "shard index out of range":
        return [*base, "runtime.num_shards=4", "runtime.shard_index=4"], 2, "runtime.shard_index must be in 0..3"
    if case == "invalid output mode":
        return [*base, "output.mode=append"], 2, "output.mode"
    if case == "non-positive grace period":
        return [*base, "runtime.grace_s=0"], 2, "runtime.grace_s"
    if case == "output holds foreign files":
        out.mkdir()
        (out / "data.csv").write_text("a")
        return base, 2, "is not empty (data.csv) and has no _job.json"
    raise AssertionError(case)


JOB_LEVEL = ["empty input folder", "glob matching nothing", "non-parquet file", "truncated parquet",
             "missing prompt column", "mistyped prompt column", "id column in some files only",
             "invalid sampling value", "unknown config key", "missing model file", "output path is a file",
             "shard index out of range", "invalid output mode", "non-positive grace period",
             "output holds foreign files"]


@pytest.mark.parametrize("case", JOB_LEVEL)
def test_job_level_errors_name_the_problem_and_write_nothing(job_runner, tiny_model_dir, tmp_path, case):
    args, expected_rc, message = setup_case(case, tmp_path, tiny_model_dir)
    rc, log = job_runner.run(args)
    assert rc == expected_rc, log
    assert message in log
    if expected_rc == 2:
        assert "Traceback" not in log
        assert "loaded" not in log  # failed before the model loaded
    assert not list((tmp_path / "out").glob("part-*")) if (tmp_path / "out").is_dir() else True


def test_resume_with_changed_model_or_existing_output_is_refused(job_runner, job_args, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    rc, log = job_runner.run([*job_args, f"output.path={out}", "runtime.num_shards=24", "runtime.shard_index=0"])
    assert rc == 0, log
    other_model = tmp_path / "model"
    other_model.mkdir()
    for f in tiny_model_dir.iterdir():
        (other_model / f.name).symlink_to(f)
    rc, log = job_runner.run([*job_args, f"output.path={out}", f"model.path={other_model}"])
    assert rc == 2 and "holds a job with a different configuration: model.path:" in log
    rc, log = job_runner.run([*job_args, f"output.path={out}", "output.mode=fail_if_exists"])
    assert rc == 2 and "output.mode=fail_if_exists" in log
    assert len(read_output(str(out))) == 2  # the one committed unit is untouched


def test_bad_rows_become_error_rows_and_every_row_is_written_once(job_runner, tiny_model_dir, tmp_path):
    long_prompt = " ".join(["word"] * 400)
    rows = [
        {"id": 1, "prompt": "A fine prompt.", "max_tokens": None},
        {"id": 2, "prompt": None, "max_tokens": None},  # null prompt
        {"id": 3, "prompt": "", "max_tokens": None},  # empty prompt
        {"id": 4, "prompt": "   \n ", "max_tokens": None},  # whitespace only
        {"id": 5, "prompt": long_prompt, "max_tokens": None},  # longer than max_model_len
        {"id": None, "prompt": "No id.", "max_tokens": None},  # null id
        {"id": 7, "prompt": "Duplicate id, first.", "max_tokens": None},  # duplicate ids: both rows kept
        {"id": 7, "prompt": "Duplicate id, second.", "max_tokens": None},
        {"id": 9, "prompt": "Bad per-row max_tokens.", "max_tokens": 0},
        {"id": 10, "prompt": "Fine again.", "max_tokens": 3},
    ]
    inp = tmp_path / "in"
    write_prompts(inp / "a.parquet", rows, pa.schema([("id", pa.int64()), ("prompt", pa.string()),
                                                      ("max_tokens", pa.int64())]))
    write_prompts(inp / "b.parquet", [], pa.schema([("id", pa.int64()), ("prompt", pa.string()),
                                                     ("max_tokens", pa.int64())]))  # an empty file
    out = tmp_path / "out"
    result = run_ok(job_runner, inp, out, tiny_model_dir,
                    "engine.max_model_len=256", "sampling.max_tokens=4", "output.rows_per_part=3")
    assert Counter(r["id"] for r in result) == Counter(r["id"] for r in rows)  # once each, dups kept
    errors = {r["id"]: r["error"] for r in result if r["finish_reason"] == "error"}
    assert "prompt is null" in errors[2]
    assert "prompt is empty" in errors[3] and "prompt is empty" in errors[4]
    assert "tokens; max_model_len=256" in errors[5]
    assert errors[None] == "id is null"
    assert "max_tokens" in errors[9]
    assert {1, 7, 10}.isdisjoint(errors)
    assert [r["completion_tokens"] for r in result if r["id"] == 10] == [3]  # the per-row override is used
    assert verify_output(str(out)).ok


def test_malformed_messages_become_error_rows(job_runner, tiny_model_dir, tmp_path):
    good = json.dumps([{"role": "user", "content": "Hello"}])
    cells = {1: good, 2: "[{not json", 3: json.dumps([{"role": "wizard", "content": "x"}]), 4: "[]",
             5: None, 6: json.dumps([{"role": "user"}]), 7: good}
    inp = tmp_path / "in.parquet"
    write_prompts(inp, [{"id": i, "messages": m} for i, m in cells.items()],
                  pa.schema([("id", pa.int64()), ("messages", pa.string())]))
    out = tmp_path / "out"
    result = run_ok(job_runner, inp, out, tiny_model_dir,
                    "input.messages_column=messages", "sampling.max_tokens=3", "output.rows_per_part=2")
    assert [r["id"] for r in result] == sorted(cells)
    errors = {r["id"]: r["error"] for r in result}
    assert errors[1] is None and errors[7] is None
    assert "malformed messages: not valid JSON" in errors[2]
    assert "unknown role 'wizard'" in errors[3]
    assert "messages is an empty list" in errors[4]
    assert "messages is null" in errors[5]
    assert "has no text content" in errors[6]


def test_invalid_utf8_and_deeply_nested_messages_become_error_rows(job_runner, tiny_model_dir, tmp_path):
    """Before, a prompt with invalid UTF-8 (UnicodeDecodeError) or a messages cell nested 5,000 deep
    (RecursionError) ended the run with a traceback and no rows written."""
    inp = tmp_path / "in"
    prompts = pa.array([b"Fine.", b"bad \xff\xfe bytes", b"Fine too."], pa.binary()).view(pa.string())
    inp.mkdir()
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": prompts}), inp / "a.parquet")  # written unvalidated
    result = run_ok(job_runner, inp, tmp_path / "out", tiny_model_dir, "sampling.max_tokens=3",
                    "output.rows_per_part=2")
    errors = {r["id"]: r["error"] for r in result}
    assert sorted(errors) == [1, 2, 3] and errors[1] is None and errors[3] is None
    assert errors[2] == "column 'prompt' is not valid UTF-8 (byte 4: invalid start byte)"

    deep = "[" * 5000 + "]" * 5000
    good = json.dumps([{"role": "user", "content": "Hello"}])
    write_prompts(tmp_path / "m.parquet", [{"id": 1, "messages": good}, {"id": 2, "messages": deep}])
    result = run_ok(job_runner, tmp_path / "m.parquet", tmp_path / "out2", tiny_model_dir,
                    "input.messages_column=messages", "sampling.max_tokens=3")
    errors = {r["id"]: r["error"] for r in result}
    assert errors == {1: None, 2: "malformed messages: JSON nested too deeply"}
