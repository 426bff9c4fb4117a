"""A real single-node Slurm for the tests: reuse a running one, else start one, else skip saying why.

Order of preference:
1. `SLURM_CONF` names a cluster that answers `sinfo` (e.g. `.ci/run` started one with
   scripts/slurm/local_cluster.sh): use it as it is and leave it running.
2. Slurm is installed (or can be: root with apt-get, unless PIPELINE_SLURM_INSTALL=0): start a private
   cluster in a temp dir on free loopback ports, and stop it by pid when the session ends.
3. Otherwise skip, with the reason (not Linux, no root, no apt-get, the install failed). An installed
   Slurm whose daemons will not start fails the tests instead: that is a bug to see.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm"
CLUSTER = SCRIPTS / "local_cluster.sh"
# States after which a task will not run again (sacct's vocabulary; the stand-in uses the same).
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE"}


@dataclass
class SlurmCluster:
    """Client side of a running cluster: its environment and a few helpers over the real commands."""

    env: dict[str, str]

    def run(self, *args: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        result = subprocess.run(list(args), env=self.env, capture_output=True, text=True, **kwargs)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr or result.stdout}")
        return result

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})},
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def states(self, job_id: str) -> dict[str, tuple[str, str]]:
        """Task id (`<job>_<i>` or `<job>`) -> (state, exit code), through `sacct` (the stand-in here)."""
        out = self.run("sacct", "-P", "-n", "-o", "JobID,State,ExitCode", "-j", job_id).stdout
        states = {}
        for line in out.splitlines():
            task, state, exit_code = line.split("|")
            states[task] = (state.split()[0], exit_code)
        return states

    def wait(self, job_id: str, tasks: int, timeout_s: float, on_poll=None) -> dict[str, tuple[str, str]]:
        """Wait until all `tasks` tasks reached a final state; `on_poll(states)` runs at each poll."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = self.states(job_id)
            if on_poll is not None:
                on_poll(states)
            if len(states) >= tasks and all(s in FINAL_STATES for s, _ in states.values()):
                return states
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} not finished after {timeout_s:.0f} s: {states}")
            time.sleep(0.5)


def _answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_env(conf: str, jobcomp: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["SLURM_CONF"] = conf
    env["PATH"] = f"{SCRIPTS / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # the sacct stand-in
    if jobcomp:
        env["PIPELINE_SLURM_JOBCOMP"] = jobcomp
    # A test session inside a Slurm job must not pass its own array variables on to the jobs it submits.
    for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        del env[key]
    return env


def _ensure_installed() -> None:
    if shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch"):
        return
    if os.environ.get("PIPELINE_SLURM_INSTALL") == "0":
        pytest.skip("Slurm is not installed and PIPELINE_SLURM_INSTALL=0 forbids installing it")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and cannot be here (needs root and apt-get: "
                    "scripts/slurm/local_cluster.sh install)")
    result = subprocess.run([str(CLUSTER), "install"], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"installing Slurm failed: {result.stderr.strip()[-500:]}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    conf = os.environ.get("SLURM_CONF")
    if conf and _answers(_client_env(conf, None)):
        yield SlurmCluster(_client_env(conf, os.environ.get("PIPELINE_SLURM_JOBCOMP")))
        return
    if not sys.platform.startswith("linux"):
        pytest.skip("the test cluster needs Linux (slurmd with proctrack/linuxproc)")
    _ensure_installed()
    if os.geteuid() != 0:
        pytest.skip("slurmd must run as root for the test cluster (it starts jobs as their users)")
    directory = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "PIPELINE_SLURM_DIR": str(directory),
           "PIPELINE_SLURM_CTLD_PORT": str(_free_port()), "PIPELINE_SLURM_SLURMD_PORT": str(_free_port())}
    started = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True)
    try:
        if started.returncode != 0:  # installed but broken: a failure to look at, not a skip
            pytest.fail(f"the test Slurm would not start: {started.stderr.strip()[-800:]}")
        yield SlurmCluster(_client_env(str(directory / "slurm.conf"), str(directory / "jobcomp.log")))
    finally:
        subprocess.run([str(CLUSTER), "stop"], env=env, capture_output=True, text=True)
