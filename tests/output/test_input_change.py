"""Changed input is found: a rewritten footer refuses the resume, edited rows under an unchanged footer fail
or redo their units (`output.on_input_change`), and `verify` names both.

Before, the fingerprint held input file names, sizes and row counts only, so rewriting the input with the
same size and row count between a crash and the resume mixed two inputs (ids twice and missing), with
rc 0, `_SUCCESS` and a clean `verify`. Then the footer was the input's identity, which a file written without
statistics keeps through an edit of the same size.
"""

from __future__ import annotations

import json
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.verify import verify_output
from pipeline.source.files import footer_digest
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
                             "(Parquet footer differs)",
                             "input rows changed since they were committed: units 000000, 000001, 000002, "
                             "000003, 000004, 000005 (in.parquet)"]  # one window: every unit's rows


def write_unstated(path, edited: int | None = None) -> None:
    """24 rows written without statistics; row `edited`'s prompt says b instead of a: the same footer."""
    rows = [{"id": i, "prompt": f"Write one line about item {'b' if i == edited else 'a'}{i:02d}."}
            for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none", use_dictionary=False,
                   write_statistics=False)


@pytest.fixture
def unstated(tiny_model_dir, tmp_path) -> list[str]:
    """Job args over `write_unstated` input: windows of 8 rows, 2 units each; prompts come out beside the text."""
    write_unstated(tmp_path / "in.parquet")
    return [f"input.path={tmp_path / 'in.parquet'}", f"model.path={tiny_model_dir}", "sampling.max_tokens=3",
            "output.rows_per_part=4", "plan.window_rows=8", "input.passthrough_columns=[prompt]",
            "engine.kv_cache_memory=32MiB", "progress.mode=off", "model.quant=none", f"output.path={tmp_path / 'out'}"]


def edit_a_committed_row(job_runner, args, tmp_path) -> str:
    """Kill the job after its first commit, then edit one row of that unit under an unchanged footer.
    Returns the unit's id."""
    rc, log = job_runner.run(args, {"PIPELINE_FAULT": "ledger.after_write:1"})
    assert rc == -signal.SIGKILL, log
    (record,) = (tmp_path / "out" / "_progress").iterdir()
    unit = json.loads(record.read_text())
    edited = read_output(str(tmp_path / "out"))[0]["id"]
    with open(tmp_path / "in.parquet", "rb") as f:
        footer = footer_digest(f)
    write_unstated(tmp_path / "in.parquet", edited)
    with open(tmp_path / "in.parquet", "rb") as f:
        assert footer_digest(f) == footer  # the fingerprint sees no change
    return unit["unit"]


def test_resume_over_edited_rows_fails_naming_the_unit_and_file(job_runner, unstated, tmp_path):
    unit = edit_a_committed_row(job_runner, unstated, tmp_path)
    rc, log = job_runner.run(unstated)
    assert rc == 2, log
    assert (f"error: input rows changed since they were committed: unit {unit} (in.parquet); restore the "
            "input, or set output.on_input_change=redo to redo those units") in log
    assert len(read_output(str(tmp_path / "out"))) == 4  # the committed unit, untouched


def test_resume_over_edited_rows_with_redo_redoes_the_unit(job_runner, unstated, tmp_path):
    unit = edit_a_committed_row(job_runner, unstated, tmp_path)
    rc, log = job_runner.run([*unstated, "output.on_input_change=redo"])
    assert rc == 0, log
    assert f"unit {unit} is redone: its input rows in in.parquet changed since it was committed" in log
    fresh = [a for a in unstated if not a.startswith("output.path=")] + [f"output.path={tmp_path / 'fresh'}"]
    assert job_runner.run(fresh)[0] == 0
    resumed, expected = read_output(str(tmp_path / "out")), read_output(str(tmp_path / "fresh"))
    assert [r["id"] for r in resumed] == sorted(range(24), key=str)  # every row exactly once
    assert [(r["id"], r["prompt"], r["text"]) for r in resumed] == [(r["id"], r["prompt"], r["text"]) for r in expected]
    assert sum("item b" in r["prompt"] for r in resumed) == 1  # the edited row's new prompt and completion
    assert verify_output(str(tmp_path / "out")).ok


def test_verify_reports_the_units_whose_input_rows_changed(job_runner, unstated, tmp_path):
    rc, log = job_runner.run(unstated)
    assert rc == 0, log
    write_unstated(tmp_path / "in.parquet", edited=13)  # row 13: window 1 (rows 8-15), units 2 and 3
    report = verify_output(str(tmp_path / "out"))
    assert report.errors == ["input rows changed since they were committed: units 000002, 000003 (in.parquet)"]
