"""A constrained run (per-row JSON schemas, n=2 seeded samples) killed mid-decode and resumed equals the
uninterrupted run row for row: a matcher's state is only its sample's tokens, rebuilt with the sample."""

from __future__ import annotations

import json
import signal

import pytest

from tests.output.jobs import read_output, write_prompts

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"label": {"enum": ["pos", "neg"]}}, "required": ["label"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
]


def test_killed_constrained_run_resumes_to_the_same_rows(job_runner, tiny_model_dir, tmp_path):
    rows = [{"id": i, "prompt": f"Item {i}: label it.", "json_schema": json.dumps(SCHEMAS[i % 2])} for i in range(24)]
    prompts = write_prompts(tmp_path / "in.parquet", rows)
    args = [f"input.path={prompts}", f"model.path={tiny_model_dir}", "sampling.max_tokens=16", "sampling.n=2",
            "sampling.temperature=0.9", "sampling.seed=11", "output.rows_per_part=2", "input.sampling_columns=[json_schema]",
            "engine.kv_cache_memory=32MiB", "engine.max_batch_size=8", "progress.mode=off", "model.quant=none"]
    rc, log = job_runner.run([*args, f"output.path={tmp_path / 'ref'}"])
    assert rc == 0, log
    rc, log = job_runner.run([*args, f"output.path={tmp_path / 'out'}"], {"PIPELINE_FAULT": "row.result:20"})
    assert rc == -signal.SIGKILL, log
    rc, log = job_runner.run([*args, f"output.path={tmp_path / 'out'}"])
    assert rc == 0, log
    keys = ("id", "sample_index", "text", "finish_reason", "error")
    want = [tuple(r[k] for k in keys) for r in read_output(str(tmp_path / "ref"))]
    assert [tuple(r[k] for k in keys) for r in read_output(str(tmp_path / "out"))] == want
    assert len(want) == 48 and sum(r[3] == "stop" for r in want) >= 24
