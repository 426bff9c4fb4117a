"""Jobs with speculative decoding on the tiny checkpoint: same greedy rows as without, metrics recorded,
resume under the same settings and refusal under changed ones."""

from __future__ import annotations

import io
import json

import polars as pl
import pytest

from pipeline.job import run
from pipeline.output.manifest import OutputConflict
from tests.e2e.test_job import job, write_shards

SPEC = ("sampling.max_tokens=16", "speculative.max_batch=8", "speculative.ngram_min=1", "sampling.logprobs=2")


def rows(out) -> list[dict]:
    return pl.read_parquet(out / "*.parquet").sort("id").select("id", "text", "finish_reason").to_dicts()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_job_writes_what_plain_writes(tmp_path, tiny_model_dir, method):
    write_shards(tmp_path / "in", (5, 3))
    run(job(tiny_model_dir, tmp_path / "in", tmp_path / "plain", *SPEC), stdout=io.StringIO())
    out = tmp_path / method
    stdout = io.StringIO()
    metrics = run(job(tiny_model_dir, tmp_path / "in", out, *SPEC, f"speculative.method={method}",
                      "output.rows_per_part=3"), stdout=stdout)
    assert rows(out) == rows(tmp_path / "plain")
    recorded = json.loads((out / "_metrics.json").read_text())["speculative"]
    assert recorded["method"] == method
    if method == "draft":  # (the random model's output never repeats itself: no n-gram to look up)
        assert recorded["proposed"] > 0 and recorded["acceptance_rate"] == 1.0  # the model drafts for itself
    assert recorded == metrics["speculative"]
    assert f"  speculative       {method}: " in stdout.getvalue()  # the end-of-run summary
    # Resume: the same settings find the output complete; changed speculation is another job.
    assert run(job(tiny_model_dir, tmp_path / "in", out, *SPEC, f"speculative.method={method}",
                   "output.rows_per_part=3"), stdout=io.StringIO())["status"] == "complete"
    with pytest.raises(OutputConflict, match="speculative"):
        run(job(tiny_model_dir, tmp_path / "in", out, *SPEC, f"speculative.method={method}", "speculative.k=2",
                "output.rows_per_part=3"), stdout=io.StringIO())
