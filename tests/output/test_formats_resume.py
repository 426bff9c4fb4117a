"""JSON Lines parts under the commit protocol: an OpenAI batch run and a gzip JSON Lines run, each SIGKILLed at
several points and resumed, end with exactly one line per request (or row), equal to an uninterrupted run."""

from __future__ import annotations

import gzip
import json
import signal
from collections import Counter

import pytest

from pipeline.output.verify import verify_output
from tests.batch_requests import read_lines, write_batch

pytestmark = pytest.mark.slow

# Kills in order: mid-decode, between a part and its record, mid-record, while the engine prefills, mid-part.
KILLS = ["row.result:40", "part.after_write:2", "ledger.mid_write:2", "row.admit:30", "part.mid_write:1"]


def stable(line: dict) -> tuple:
    """What must not depend on interruptions: not `created` (when the line was written), cached tokens (what
    the cache happened to hold) or the last bits of a log-probability (the batch it ran in)."""
    if line["response"] is None:
        return line["id"], line["custom_id"], line["error"]["message"]
    body = line["response"]["body"]
    choices = [(c["index"], c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
               for c in body["choices"]]
    return (line["id"], line["custom_id"], body["id"], body["object"], str(choices), body["usage"]["prompt_tokens"],
            body["usage"]["completion_tokens"])


def kill_and_resume(job_runner, args: list[str], out: str, kills: list[str] = KILLS) -> None:
    for fault in kills:
        rc, log = job_runner.run([*args, f"output.path={out}"], {"PIPELINE_FAULT": fault})
        assert rc == -signal.SIGKILL, f"{fault} was not reached (rc {rc}):\n{log}"
    rc, log = job_runner.run([*args, f"output.path={out}"])
    assert rc == 0, log


def test_killed_openai_batch_run_resumes_to_one_line_per_request(job_runner, tiny_model_dir, tmp_path):
    batch = write_batch(tmp_path / "batch.jsonl")
    args = [f"input.path={batch}", "input.format=openai_batch", f"model.path={tiny_model_dir}",
            "output.rows_per_part=16", "engine.kv_cache_memory=32MiB", "engine.max_batch_size=16",
            "progress.mode=off", "model.quant=none"]
    rc, log = job_runner.run([*args, f"output.path={tmp_path / 'ref'}"])
    assert rc == 0, log
    kill_and_resume(job_runner, args, str(tmp_path / "out"))
    lines = read_lines(str(tmp_path / "out"))
    assert Counter(line["custom_id"] for line in lines) == Counter(
        [*(f"req-{i}" for i in range(200) if i not in (17, 67)), None, None])  # each request once
    assert sorted(map(stable, lines)) == sorted(map(stable, read_lines(str(tmp_path / "ref"))))
    report = verify_output(str(tmp_path / "out"))
    assert report.ok and report.rows == 200, report.errors


def test_killed_jsonl_run_resumes_to_the_uninterrupted_rows(job_runner, tiny_model_dir, tmp_path):
    rows = [{"id": f"row-{i}", "prompt": f"Write one line about item {i % 7}, take {i // 7}."} for i in range(60)]
    with gzip.open(tmp_path / "in.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    args = [f"input.path={tmp_path / 'in.jsonl.gz'}", "input.format=jsonl", f"model.path={tiny_model_dir}",
            "sampling.max_tokens=5", "output.rows_per_part=4", "engine.kv_cache_memory=32MiB",
            "engine.max_batch_size=8", "progress.mode=off", "model.quant=none"]
    rc, log = job_runner.run([*args, f"output.path={tmp_path / 'ref'}"])
    assert rc == 0, log
    kill_and_resume(job_runner, args, str(tmp_path / "out"),
                    ["row.result:10", "part.after_write:2", "ledger.mid_write:1", "row.admit:3", "part.mid_write:1"])
    key = lambda row: row["id"]  # noqa: E731
    stable = ("id", "sample_index", "text", "prompt_tokens", "completion_tokens", "finish_reason", "error")
    got = sorted(read_lines(str(tmp_path / "out")), key=key)
    assert [r["id"] for r in got] == sorted(r["id"] for r in rows)  # each row once
    assert [[r[k] for k in stable] for r in got] == [
        [r[k] for k in stable] for r in sorted(read_lines(str(tmp_path / "ref")), key=key)]
    assert verify_output(str(tmp_path / "out")).ok
