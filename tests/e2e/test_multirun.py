"""`python -m pipeline -m key=a,b`: Hydra's multirun gives each job its own output folder.

Before, every job of the sweep wrote to the same `output.path` and the second was refused as "a different
configuration"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import hydra_argv, per_job_output_path
from pipeline.output.verify import verify_output

REPO = Path(__file__).resolve().parents[2]


def test_per_job_output_path():
    assert per_job_output_path("out/run/", "sampling.temperature=0.7") == "out/run/sampling.temperature=0.7"
    assert per_job_output_path("s3://b/run", "") == "s3://b/run"  # only shards (runtime.*) swept: one output


def test_shard_sweeps_do_not_name_an_output_folder():
    argv = hydra_argv(["-m", "runtime.shard_index=range(0,4)", "runtime.num_shards=4", "sampling.temperature=0,0.7",
                       "output.path=a,b"])
    excluded = next(a for a in argv if a.startswith("hydra.job.config.override_dirname.exclude_keys="))
    keys = set(excluded.split("=", 1)[1].strip("[]").split(","))
    assert keys == {"runtime.shard_index", "runtime.num_shards", "output.path"}


@pytest.mark.slow
def test_multirun_writes_one_complete_output_per_job(tmp_path, tiny_model_dir):
    pq.write_table(pa.table({"id": [1, 2, 3], "prompt": ["One.", "Two.", "Three."]}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "-m", "sampling.temperature=0,0.7", f"input.path={tmp_path}/in.parquet",
         f"output.path={out}", f"model.path={tiny_model_dir}", "sampling.max_tokens=3", "progress.mode=off",
         "engine.kv_cache_memory=16MiB", "model.quant=none", f"hydra.sweep.dir={tmp_path}/sweep"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    folders = sorted(p.name for p in out.iterdir())
    assert folders == ["sampling.temperature=0", "sampling.temperature=0.7"]
    for name in folders:
        report = verify_output(str(out / name))
        assert report.ok and report.rows == 3, report.errors
        assert (out / name / "_SUCCESS").exists()
