"""Whole jobs with `engine.tensor_parallel`: same output as one rank; a killed worker, SIGTERM or Ctrl-C
end the job quickly with every process gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import psutil
import pytest

from pipeline.config import load_job_config
from pipeline.job import run
from tests.e2e.test_job import write_shards
from tests.test_config import compose_job

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
COLUMNS = ["id", "text", "token_ids", "finish_reason"]


def overrides(tmp_path: Path, model_dir: Path, out: str, *extra: str) -> list[str]:
    return [f"input.path={tmp_path}/in/*.parquet", f"output.path={tmp_path}/{out}", f"model.path={model_dir}",
            "engine.kv_cache_memory=16MiB", "output.token_ids=true", "model.quant=none", *extra]


def test_job_with_two_ranks_writes_what_one_rank_writes(tmp_path, tiny_model_dir, no_orphans):
    write_shards(tmp_path / "in", (6, 5))
    outputs = []
    for n in (1, 2):
        cfg = load_job_config(compose_job(*overrides(
            tmp_path, tiny_model_dir, f"out{n}", "sampling.max_tokens=6", "progress.mode=off",
            f"engine.tensor_parallel={n}")))
        run(cfg, stdout=open(os.devnull, "w"))  # noqa: SIM115
        outputs.append(pl.read_parquet(tmp_path / f"out{n}" / "*.parquet").sort("id").select(COLUMNS))
    assert outputs[0].height == 11
    assert outputs[0].equals(outputs[1])


class RunningJob:
    """`python -m pipeline` with two ranks in its own session, its output collected by a thread."""

    def __init__(self, tmp_path: Path, model_dir: Path, env: dict[str, str] | None = None):
        write_shards(tmp_path / "in", (300,))
        args = overrides(tmp_path, model_dir, "out", "sampling.max_tokens=64", "engine.max_batch_size=4",
                         "progress.mode=log", "progress.log_every_s=0.05", "engine.tensor_parallel=2",
                         "runtime.grace_s=3")
        env = os.environ | {"PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"} | (env or {})
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.generating = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if (" rows " in line and "gen " in line) or ": hanging" in line:
                self.generating.set()

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def workers(self) -> list[psutil.Process]:
        return [p for p in self.descendants() if "resource_tracker" not in " ".join(p.cmdline())]

    def wait_generating(self) -> list[psutil.Process]:
        assert self.generating.wait(120), "".join(self.lines)
        return self.descendants()

    def finish(self, timeout: float) -> tuple[int, str]:
        """Exit code and output; `timeout` only guards against a hang (it decides no verdict)."""
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(60)  # every writer of the pipe is gone: everything is read
        return code, "".join(self.lines)


def assert_gone(procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 60  # a guard against a hang, not a speed requirement
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def test_killing_a_worker_ends_the_job_with_the_rank_named(tmp_path, tiny_model_dir):
    job = RunningJob(tmp_path, tiny_model_dir)
    everything = job.wait_generating()
    (worker,) = job.workers()
    worker.kill()
    code, output = job.finish(timeout=60)
    assert code == 2, output
    assert "error: tensor-parallel worker rank 1 (of 2) was killed by signal SIGKILL" in output
    assert_gone(everything)


@pytest.mark.parametrize("how", ["sigterm-rank0", "ctrl-c-group"])
def test_stop_signal_stops_every_rank(tmp_path, tiny_model_dir, how):
    # The job hangs at its 5th result, so it is still running whatever the machine's speed.
    job = RunningJob(tmp_path, tiny_model_dir, {"PIPELINE_FAULT": "row.result:5:hang"})
    everything = job.wait_generating()
    if how == "sigterm-rank0":
        job.proc.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C reaches the whole foreground process group
        os.killpg(job.proc.pid, signal.SIGINT)
    code, output = job.finish(timeout=60)
    assert code == 75, output  # interrupted, committed work kept (pipeline/output/signals.py)
    assert "Traceback" not in output
    assert_gone(everything)
