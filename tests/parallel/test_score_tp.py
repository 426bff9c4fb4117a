"""task=score under tensor parallelism: a score needs only logits, which every rank's runner computes, so
two ranks write what one rank writes (up to float rounding: the ranks sum partial matmuls). task=embed needs
the final hidden states, which the ranks' runners do not return: refused at start (tests/task)."""

from __future__ import annotations

import io
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_job_config
from pipeline.job import run
from tests.test_config import compose_job

pytestmark = pytest.mark.slow


def test_score_with_two_ranks_writes_what_one_rank_writes(tmp_path, tiny_model_dir, no_orphans):
    rows = [{"id": i, "prompt": f"Question {i}: is it true?", "candidates": [" yes", " no", " it depends"]}
            for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    outputs = []
    for ranks in (1, 2):
        cfg = load_job_config(compose_job(
            f"input.path={tmp_path}/in.parquet", f"output.path={tmp_path}/out{ranks}", f"model.path={tiny_model_dir}",
            "task=score", "engine.kv_cache_memory=16MiB", "model.quant=none", "progress.mode=off",
            f"engine.tensor_parallel={ranks}"))
        run(cfg, stdout=io.StringIO())
        outputs.append({r["id"]: r for r in pq.read_table(tmp_path / f"out{ranks}").to_pylist()})
    one, two = outputs
    assert sorted(two) == list(range(6))
    for i, row in one.items():
        assert two[i]["error"] is None and two[i]["best_candidate"] == row["best_candidate"]
        for a, b in zip(row["scores"], two[i]["scores"], strict=True):
            assert a["num_tokens"] == b["num_tokens"] and math.isclose(a["logprob_sum"], b["logprob_sum"], abs_tol=1e-4)
