"""The `task` key and the keys it brings (`input.candidates_column`, `embed.*`): defaults, checks at start,
and the job fingerprint."""

from __future__ import annotations

import functools

import pytest

from pipeline.config import load_job_config
from pipeline.engine.prefill import Embed
from pipeline.errors import JobError
from tests.test_config import compose_job, fingerprint_of


def test_task_defaults_and_overrides():
    job = load_job_config(compose_job())
    assert (job.task, job.embed, job.input.candidates_column) == ("generate", Embed("last", True), "candidates")
    job = load_job_config(compose_job("task=embed", "embed.pooling=mean", "embed.normalize=false"))
    assert (job.task, job.embed) == ("embed", Embed("mean", False))
    assert load_job_config(compose_job("task=score", "input.candidates_column=choices")).input.candidates_column == "choices"


@pytest.mark.parametrize(("overrides", "message"), [
    (["task=rank"], "invalid config `task`: 'rank'; expected one of generate, score, embed"),
    (["task=score", "sampling.n=2"], "invalid config `sampling.n`: 2; task=score writes one row per input row"),
    (["task=embed", "sampling.prompt_logprobs=2"], "invalid config `sampling.prompt_logprobs`: it applies to task=generate"),
    (["task=score", "input.candidates_column=''"], "invalid config `input.candidates_column`: empty"),
    (["task=embed", "embed.pooling=max"], "invalid config `embed`: pooling must be one of last, mean, got 'max'"),
    (["task=embed", "engine.tensor_parallel=2"], "task=embed runs on one rank: engine.tensor_parallel=2 is not supported"),
])
def test_bad_task_settings_fail_at_start(overrides, message):
    with pytest.raises(JobError) as e:
        load_job_config(compose_job(*overrides))
    assert str(e.value).startswith(message)


def test_fingerprint_names_the_task_and_only_its_keys(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")

    fingerprint = functools.partial(fingerprint_of, model)

    generate = fingerprint()
    assert "task" not in generate and "embed" not in generate and "candidates_column" not in generate["input"]
    assert fingerprint("input.candidates_column=x", "embed.pooling=mean") == generate  # not generate's keys
    score = fingerprint("task=score")
    assert score["task"] == "score" and score["input"]["candidates_column"] == "candidates"
    assert fingerprint("task=score", "input.candidates_column=x") != score
    assert fingerprint("task=score", "embed.pooling=mean") == score
    embed = fingerprint("task=embed")
    assert embed["embed"] == {"pooling": "last", "normalize": True}
    assert fingerprint("task=embed", "embed.normalize=false") != embed
