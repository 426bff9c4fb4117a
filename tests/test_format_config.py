"""`input.format` and `output.format`: their choices, `auto`, and what they add to the job fingerprint."""

from __future__ import annotations

import functools

import pytest

from pipeline.config import load_job_config
from pipeline.errors import JobError
from tests.test_config import compose_job, fingerprint_of


def test_output_format_auto_follows_the_input():
    def resolved(*overrides: str) -> str:
        return load_job_config(compose_job(*overrides)).output_format

    assert resolved() == "parquet"
    assert resolved("input.format=jsonl") == "jsonl"
    assert resolved("input.format=openai_batch") == "openai_batch"
    assert resolved("input.format=openai_batch", "output.format=parquet") == "parquet"
    assert resolved("output.format=jsonl") == "jsonl"


@pytest.mark.parametrize("overrides, words", [
    (("input.format=csv",), "input.format"),
    (("output.format=xml",), "output.format"),
    (("input.format=openai_batch", "output.retry_errors=true"), "output.retry_errors"),
    (("output.format=openai_batch", "output.retry_errors=true"), "output.retry_errors"),
    (("task=score", "output.format=openai_batch"), "task=score writes parquet or jsonl"),
])
def test_bad_formats_fail_at_start(overrides, words):
    with pytest.raises(JobError, match=words):
        load_job_config(compose_job(*overrides))


def test_formats_in_the_fingerprint(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"1234")

    fingerprint = functools.partial(fingerprint_of, model)

    base = fingerprint()
    # the defaults add nothing, so outputs written before the formats existed still resume
    assert "format" not in base["input"] and "format" not in base["output"]
    assert fingerprint("input.format=parquet", "output.format=parquet") == base
    assert fingerprint("input.format=jsonl")["input"]["format"] == "jsonl"
    assert fingerprint("input.format=jsonl")["output"]["format"] == "jsonl"  # auto, resolved
    assert fingerprint("output.format=openai_batch")["output"] == {"token_ids": False, "format": "openai_batch"}
    assert fingerprint("input.format=jsonl", "output.format=parquet")["output"] == base["output"]
