"""The Slurm plumbing against a real single-node Slurm: accounting through the sacct stand-in, submitit
noticing a task that died without a result, and pipeline.sbatch's signal / requeue logic.

The job inside pipeline.sbatch is a small stand-in here (PIPELINE_PYTHON) so that the shell's behaviour is
checked exactly: which signal reaches the job, which exit status leads to a requeue. The real pipeline
runs under the same script in test_array.py.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import SCRIPTS, SlurmCluster

SBATCH = SCRIPTS / "pipeline.sbatch"
pytestmark = [pytest.mark.slow, pytest.mark.slurm]  # real daemons and jobs: seconds each


def test_sacct_standin_reports_each_array_task(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch("--array=0-3", f"--output={tmp_path}/%A_%a.out",
                               "--wrap", "exit $(( SLURM_ARRAY_TASK_ID == 2 ? 3 : 0 ))")
    states = slurm_cluster.wait(job, tasks=4, timeout_s=60)
    assert states == {f"{job}_0": ("COMPLETED", "0:0"), f"{job}_1": ("COMPLETED", "0:0"),
                      f"{job}_2": ("FAILED", "3:0"), f"{job}_3": ("COMPLETED", "0:0")}
    # A job that has just ended may not be in the completion log yet: the controller's exit code stands in.
    without_log = SlurmCluster({**slurm_cluster.env, "PIPELINE_SLURM_JOBCOMP": str(tmp_path / "no-such.log")})
    assert without_log.states(job) == states


def test_sacct_standin_reports_a_signal_as_sacct_does(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(f"--output={tmp_path}/%j.out", "--wrap", "kill -KILL $$")
    assert slurm_cluster.wait(job, tasks=1, timeout_s=60) == {job: ("FAILED", "0:9")}


def test_submitit_learns_that_a_task_died(slurm_cluster, tmp_path, monkeypatch):
    """Without accounting, submitit would wait forever on the killed task (state UNKNOWN)."""
    submitit = pytest.importorskip("submitit")
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(timeout_min=5, cpus_per_task=1)
    ok = executor.submit(pow, 2, 10)
    dead = executor.submit(_kill_self)
    deadline = time.monotonic() + 90
    while not (ok.done() and dead.done()):
        assert time.monotonic() < deadline, f"submitit still waiting: {ok.state}, {dead.state}"
        time.sleep(1)
    assert ok.result() == 1024
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="has not produced any output"):
        dead.result()


def _kill_self() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def fake_job(tmp_path) -> Path:
    """A `python` for pipeline.sbatch: logs the signals it gets; on SIGUSR1 exits 75, else 0 after a while."""
    path = tmp_path / "fake-python"
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, signal, sys, time
        got = []
        for s in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        print("fake start", restart, sys.argv[1:], flush=True)
        deadline = time.monotonic() + float(os.environ["FAKE_SECONDS"])
        while time.monotonic() < deadline and not got:
            time.sleep(0.05)
        print("fake signals", got, flush=True)
        sys.exit(75 if got else 0)
        """))
    path.chmod(0o755)
    return path


def _log(tmp_path: Path, job: str, task: int) -> str:
    return (tmp_path / f"{job}_{task}.out").read_text()


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_sbatch_requeues_a_task_interrupted_by_usr1(slurm_cluster, tmp_path, fake_job):
    env = {"PIPELINE_PYTHON": str(fake_job), "FAKE_SECONDS": "4"}
    job = slurm_cluster.sbatch("--array=0-1", "--cpus-per-task=1", f"--output={tmp_path}/%A_%a.out",
                               str(SBATCH), "conf=job.yaml", "x=1", env=env)
    _wait_for(lambda: (tmp_path / f"{job}_1.out").exists() and "fake start" in _log(tmp_path, job, 1), 30,
              "task 1 to start")
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", f"{job}_1")
    states = slurm_cluster.wait(job, tasks=2, timeout_s=60)
    assert states == {f"{job}_0": ("COMPLETED", "0:0"), f"{job}_1": ("COMPLETED", "0:0")}
    log1 = _log(tmp_path, job, 1)
    # The signal reached the job once (not twice), the shell requeued on 75, the rerun finished.
    assert "fake start 0 ['-m', 'pipeline', 'conf=job.yaml', 'x=1']" in log1
    assert "fake signals ['SIGUSR1']" in log1
    assert "job exited with status 75" in log1 and "requeueing to resume" in log1
    assert "fake start 1 " in log1 and "fake signals []" in log1
    log0 = _log(tmp_path, job, 0)
    assert "requeueing" not in log0 and "fake start 1 " not in log0


def test_sbatch_does_not_requeue_a_cancelled_task(slurm_cluster, tmp_path, fake_job):
    env = {"PIPELINE_PYTHON": str(fake_job), "FAKE_SECONDS": "30"}
    job = slurm_cluster.sbatch("--cpus-per-task=1", f"--output={tmp_path}/%j_0.out", str(SBATCH), env=env)
    _wait_for(lambda: (tmp_path / f"{job}_0.out").exists() and "fake start" in _log(tmp_path, job, 0), 30,
              "the task to start")
    slurm_cluster.run("scancel", job)
    states = slurm_cluster.wait(job, tasks=1, timeout_s=60)
    assert states[job][0] == "CANCELLED"
    time.sleep(1)  # a wrongly issued requeue would have made it pending again by now
    assert slurm_cluster.states(job)[job][0] == "CANCELLED"
    assert "requeueing" not in _log(tmp_path, job, 0)


def test_sbatch_gives_up_after_max_requeues(slurm_cluster, tmp_path, fake_job):
    env = {"PIPELINE_PYTHON": str(fake_job), "FAKE_SECONDS": "30", "PIPELINE_MAX_REQUEUES": "0"}
    job = slurm_cluster.sbatch("--cpus-per-task=1", f"--output={tmp_path}/%j_0.out", str(SBATCH), env=env)
    _wait_for(lambda: (tmp_path / f"{job}_0.out").exists() and "fake start" in _log(tmp_path, job, 0), 30,
              "the task to start")
    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)
    states = slurm_cluster.wait(job, tasks=1, timeout_s=60)
    assert states[job] == ("FAILED", "75:0")
    assert "not requeueing" in _log(tmp_path, job, 0)


def test_time_limit_warning_reaches_the_job(slurm_cluster, tmp_path, fake_job):
    """--signal=B:USR1@50 with a 1-minute limit: Slurm itself signals the shell, which passes it on."""
    env = {"PIPELINE_PYTHON": str(fake_job), "FAKE_SECONDS": "55", "PIPELINE_MAX_REQUEUES": "0"}
    job = slurm_cluster.sbatch("--cpus-per-task=1", "--time=1", "--signal=B:USR1@50",
                               f"--output={tmp_path}/%j_0.out", str(SBATCH), env=env)
    states = slurm_cluster.wait(job, tasks=1, timeout_s=90)
    log = _log(tmp_path, job, 0)
    assert "fake signals ['SIGUSR1']" in log, log
    assert states[job] == ("FAILED", "75:0")
