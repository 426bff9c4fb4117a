"""A finished output folder is a Parquet dataset every reader opens: only part files have visible names.

Before, `metrics.json` and the report sat beside the parts, and `pyarrow.dataset.dataset(out)` failed
("Could not read schema from metrics.json"). Polars 2.x, given a bare directory, reads every non-empty file
under it whatever its name (the job's `_job.json` and `_progress/` included), so polars is given the glob.
"""

from __future__ import annotations

import io

import polars as pl
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from pipeline.job import run
from tests.e2e.test_job import job, write_shards

REPORT = ("output.report=true", "output.report_interval_s=0.01", "hardware.bandwidth_tbs=0.02",
          "hardware.memory_gb=8", "hardware.peak_tflops.fp32=0.1", "hardware.peak_tflops.bf16=0.01")


def test_every_reader_opens_the_output_folder(tmp_path, tiny_model_dir):
    n_rows = write_shards(tmp_path / "in", (5, 4))
    out = tmp_path / "out"
    run(job(tiny_model_dir, f"{tmp_path}/in/*.parquet", out, "output.rows_per_part=3", *REPORT), stdout=io.StringIO())
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith(("_", ".")))
    assert visible == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert (out / "_metrics.json").is_file() and (out / "_report" / "report.html").is_file()

    expected = list(range(n_rows))
    assert sorted(pl.read_parquet(f"{out}/*.parquet")["id"].to_list()) == expected
    assert sorted(pl.scan_parquet(f"{out}/**/*.parquet").collect()["id"].to_list()) == expected
    assert sorted(ds.dataset(out).to_table()["id"].to_pylist()) == expected
    assert sorted(pq.read_table(out)["id"].to_pylist()) == expected
