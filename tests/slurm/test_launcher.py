"""Hydra's submitit launcher route: `python -m pipeline -m hydra/launcher=slurm runtime.shard_index=...`
submits one Slurm task per shard, waits for them (through `sacct`, the stand-in here) and the output holds
every input row exactly once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.slurm.conftest import REPO
from tests.slurm.test_array import assert_exact_and_verified, job_args, job_env

pytestmark = [pytest.mark.slow, pytest.mark.slurm]


def test_submitit_launcher_runs_every_shard(slurm_cluster, tiny_model_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "pipeline", "-m", "hydra/launcher=slurm",
               "runtime.num_shards=4", "runtime.shard_index=range(0,4)",
               *job_args(tiny_model_dir, out, "sampling.max_tokens=4", "output.rows_per_part=10"),
               "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
               f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    result = subprocess.run(command, cwd=REPO, env={**slurm_cluster.env, **job_env()}, capture_output=True,
                            text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    for shard in range(4):  # Hydra lists each submitted sweep job
        assert f"runtime.num_shards=4 runtime.shard_index={shard}" in result.stdout + result.stderr
    assert_exact_and_verified(out)
