"""Input content is part of the fingerprint: a resume over rewritten input is refused, naming the file.

Before, the fingerprint held input file names, sizes and row counts only, so rewriting the input with the
same size and row count between a crash and the resume mixed two inputs (ids twice and missing), with
rc 0, `_SUCCESS` and a clean `verify`.
"""

from __future__ import annotations

import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output

pytestmark = pytest.mark.slow


def write_input(path, letter: str) -> None:
    """24 rows whose prompts differ only in one letter: same file size and row count for any letter."""
    rows = [{"id": i, "prompt": f"Write one line about item {letter}{i:02d}."} for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none", use_dictionary=False)


@pytest.fixture
def args(tiny_model_dir, tmp_path) -> list[str]:
    write_input(tmp_path / "in.parquet", "a")
    return [f"input.path={tmp_path / 'in.parquet'}", f"model.path={tiny_model_dir}", "sampling.max_tokens=3",
            "output.rows_per_part=4", "engine.kv_cache_memory=32MiB", "progress.mode=off", "model.quant=none",
            f"output.path={tmp_path / 'out'}"]


def test_resume_over_rewritten_input_is_refused_naming_the_file(job_runner, args, tmp_path):
    rc, log = job_runner.run(args, {"PIPELINE_FAULT": "ledger.after_write:2"})
    assert rc == -signal.SIGKILL, log
    size = (tmp_path / "in.parquet").stat().st_size
    write_input(tmp_path / "in.parquet", "b")
    assert (tmp_path / "in.parquet").stat().st_size == size  # what the old fingerprint compared
    rc, log = job_runner.run(args)
    assert rc == 2, log
    assert "holds a job with a different configuration: input_content.in.parquet" in log
    assert len(read_output(str(tmp_path / "out"))) == 8  # the two committed units, untouched


def test_verify_reports_input_changed_after_the_job(job_runner, args, tmp_path):
    rc, log = job_runner.run(args)
    assert rc == 0, log
    assert verify_output(str(tmp_path / "out")).ok
    write_input(tmp_path / "in.parquet", "c")
    report = verify_output(str(tmp_path / "out"))
    assert not report.ok
    assert report.errors == [f"input file file://{tmp_path}/in.parquet changed since the job read it "
                             "(Parquet footer differs)"]
