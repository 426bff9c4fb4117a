"""The same engine code under `torchrun`: ranks come from its environment instead of being spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from pipeline.model.loader import load_model
from tests.e2e.test_job import write_shards
from tests.parallel.engine_helpers import greedy, random_prompts

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one(tmp_path, tiny_model_dir, no_orphans):
    out = tmp_path / "tokens.json"
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "tests/parallel/torchrun_greedy.py"), str(tiny_model_dir), str(out), "2"]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    got = {int(k): v for k, v in json.loads(out.read_text()).items()}
    reference = greedy(load_model(tiny_model_dir), random_prompts(8, vocab=49152), 6)
    assert got == {i: tokens for i, (tokens, _) in reference.items()}


@pytest.mark.slow
def test_job_under_torchrun_writes_what_one_rank_writes(tmp_path, tiny_model_dir):
    write_shards(tmp_path / "in", (5, 4))
    env = os.environ | {"PYTHONPATH": str(REPO), "OMP_WAIT_POLICY": "PASSIVE"}
    common = [f"input.path={tmp_path}/in/*.parquet", f"model.path={tiny_model_dir}", "engine.kv_cache_memory=16MiB",
              "output.token_ids=true", "sampling.max_tokens=6", "progress.mode=off", "model.quant=none"]
    launchers = {1: [sys.executable, "-m", "pipeline"],
                 2: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "-m", "pipeline"]}
    tables = []
    for n, launcher in launchers.items():
        cmd = [*launcher, *common, f"output.path={tmp_path}/out{n}", f"engine.tensor_parallel={n}"]
        done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        tables.append(pl.read_parquet(tmp_path / f"out{n}" / "*.parquet").sort("id").select(
            ["id", "text", "token_ids", "finish_reason"]))
    assert tables[0].height == 9 and tables[0].equals(tables[1])
