"""SIGTERM mid-run: exit 75 within the grace period, committed rows kept, resume finishes the output.
And a second job on the same output fails fast with a clear message (exit 73)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output, wait_for, write_prompts

pytestmark = pytest.mark.slow

GRACE_S = 2.0
LONG = 300


@pytest.fixture(scope="module")
def slow_args(tiny_model_dir, tmp_path_factory) -> list[str]:
    """Unit 0 (two rows, 2 tokens) commits at once; the other rows need LONG tokens each (seconds)."""
    rows = [{"id": i, "prompt": f"Tell a long story number {i}.", "max_tokens": 2 if i < 2 else LONG}
            for i in range(8)]
    path = write_prompts(tmp_path_factory.mktemp("slow") / "in.parquet", rows)
    return [f"input.path={path}", f"model.path={tiny_model_dir}", "sampling.ignore_eos=true",
            "output.rows_per_part=2", "engine.kv_cache_memory=32MiB", "progress.mode=off",
            f"runtime.grace_s={GRACE_S}"]


def test_sigterm_commits_finished_units_exits_75_in_grace_and_resume_completes(
        job_runner, slow_args, tmp_path):
    out = tmp_path / "out"
    pid, log = job_runner.start([*slow_args, f"output.path={out}"])
    wait_for(lambda: (out / "_progress" / "000000.json").exists(), timeout_s=120)

    # A second job on the same output fails fast, naming the holder.
    t0 = time.monotonic()
    rc, other = job_runner.run([*slow_args, f"output.path={out}"])
    assert rc == 73 and "output is in use by another job" in other and f"pid {pid}" in other
    assert time.monotonic() - t0 < 30  # no model load, no waiting for the lease

    os.kill(pid, signal.SIGTERM)
    t0 = time.monotonic()
    rc = job_runner.wait(pid)
    elapsed = time.monotonic() - t0
    assert rc == 75, log.read_text()
    assert elapsed < GRACE_S + 0.5, elapsed
    assert "interrupted:" in log.read_text()

    committed = read_output(str(out))
    assert [r["id"] for r in committed][:2] == [0, 1]  # the finished unit is there, whole
    report = verify_output(str(out))
    assert all("not committed" in e for e in report.errors) and report.rows == len(committed)
    assert not (out / "_lease" / "all.json").exists()  # released on the way out

    rc, text = job_runner.run([*slow_args, f"output.path={out}"])
    assert rc == 0, text
    final = read_output(str(out))
    assert [r["id"] for r in final] == list(range(8))
    assert final[:2] == committed[:2]  # the committed unit was not redone
    assert [r["completion_tokens"] for r in final] == [2, 2] + [LONG] * 6
    assert verify_output(str(out)).ok and (out / "_SUCCESS").exists()
