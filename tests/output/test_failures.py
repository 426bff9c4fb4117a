"""Failures around the output: a clear one-line error naming the file and the cause, nothing left behind
that blocks the corrected rerun, and damaged bookkeeping either redone or reported, never a traceback."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline.errors import JobError
from pipeline.output.ledger import write_whole
from pipeline.output.verify import verify_output
from tests.output.jobs import REPO, read_output


class FullDisk(MemoryFileSystem):
    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_write_names_the_file_and_the_cause(tmp_path):
    with pytest.raises(JobError, match=r"cannot write /out/_job.json: No space left on device"):
        write_whole(FullDisk(skip_instance_cache=True), "/out/_job.json", b"{}", "manifest")
    (tmp_path / "_progress").write_text("a file where the ledger folder should be")
    with pytest.raises(JobError, match=rf"cannot write {tmp_path}/_progress/000000.json: "):
        write_whole(fsspec.filesystem("file"), f"{tmp_path}/_progress/000000.json", b"{}", "ledger")


@pytest.mark.slow
def test_output_path_that_cannot_be_created_is_a_clear_error(job_runner, job_args, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, log = job_runner.run([*job_args, f"output.path={blocker}/out"])
    assert rc == 2, log
    assert f"error: cannot use output.path {blocker}/out: " in log and "Traceback" not in log


@pytest.mark.slow
def test_failed_model_load_leaves_nothing_that_blocks_the_corrected_rerun(job_runner, job_args, tiny_model_dir,
                                                                           tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = sorted(model.glob("*.safetensors"))[0]
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 3])  # a truncated download
    out = tmp_path / "out"
    rc, log = job_runner.run([*job_args, f"model.path={model}", f"output.path={out}"])
    assert rc == 2 and "cannot load model" in log, log
    assert not (out / "_job.json").exists()
    weights.write_bytes(good)  # fixed: same path, other size (part of the fingerprint)
    rc, log = job_runner.run([*job_args, f"model.path={model}", f"output.path={out}"])
    assert rc == 0, log
    assert len(read_output(str(out))) == 48


@pytest.mark.slow
def test_truncated_ledger_record_is_redone_on_resume_and_reported_by_verify(job_runner, job_args, tmp_path):
    out = tmp_path / "out"
    rc, log = job_runner.run([*job_args, f"output.path={out}", "runtime.num_shards=2", "runtime.shard_index=0"])
    assert rc == 0, log
    (out / "_progress" / "000003.json").write_bytes(b'{"unit": "000003", "pa')  # cut mid-write by a disk fault
    report = verify_output(str(out))
    assert any(e.startswith("unreadable ledger record") and "000003.json" in e for e in report.errors)
    rc, log = job_runner.run([*job_args, f"output.path={out}"])
    assert rc == 0, log
    assert "unit 000003 is redone: unreadable ledger record" in log
    assert len(read_output(str(out))) == 48 and verify_output(str(out)).ok


def test_verify_of_a_corrupt_job_manifest_is_a_one_line_error(tmp_path):
    (tmp_path / "_job.json").write_text('{"digest": "ab')
    cli = subprocess.run([sys.executable, "-m", "pipeline.verify", str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True)
    assert cli.returncode == 2
    assert cli.stderr == f"error: {tmp_path}/_job.json is not a job manifest; remove it or use another output.path\n"


@pytest.mark.slow
def test_resume_after_the_last_commit_writes_metrics_and_leaves_no_temp_files(job_runner, job_args, tmp_path):
    out = tmp_path / "out"
    for fault in ("part.mid_write:2", "ledger.mid_write:3", "metrics.mid_write:1"):
        rc, log = job_runner.run([*job_args, f"output.path={out}"], {"PIPELINE_FAULT": fault})
        assert rc == -9, log
    assert list(out.rglob(".*.tmp-*"))  # the interrupted writes left temp files
    assert not (out / "_metrics.json").exists()
    rc, log = job_runner.run([*job_args, f"output.path={out}"])
    assert rc == 0, log
    assert (out / "_SUCCESS").exists() and (out / "_metrics.json").exists()
    assert not list(out.rglob(".*.tmp-*"))


@pytest.mark.slow
def test_max_tokens_beyond_the_model_length_is_refused_at_start(job_runner, job_args, tmp_path):
    rc, log = job_runner.run([*job_args, f"output.path={tmp_path / 'out'}", "sampling.max_tokens=100000000"])
    assert rc == 2, log
    assert "sampling.max_tokens=100000000 leaves no room for a prompt in max_model_len=" in log
    assert "every row would be an error row" in log and not (tmp_path / "out" / "_job.json").exists()


@pytest.mark.slow
def test_a_kv_cache_smaller_than_one_block_is_refused_before_the_model_loads(job_runner, job_args, tmp_path):
    rc, log = job_runner.run([*job_args, f"output.path={tmp_path / 'out'}", "engine.kv_cache_memory=1KB"])
    assert rc == 2, log
    assert "engine.kv_cache_memory='1KB' is less than one KV cache block of this model" in log
    assert "loaded" not in log and not (tmp_path / "out").exists()
