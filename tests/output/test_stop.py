"""SIGTERM mid-run: exit 75 when the grace period is spent, committed rows kept, resume finishes the output.
And a second job on the same output fails fast with a clear message (exit 73).

Nothing here depends on the machine's speed: the job hangs at its third result (`PIPELINE_FAULT=...:hang`),
after unit 0 is committed and before any other unit can be, so its remaining work never finishes on its
own and only the grace timer can end it.
"""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output, wait_for, write_prompts

pytestmark = pytest.mark.slow

GRACE_S = 2.0
LONG = 30
HANG = {"PIPELINE_FAULT": "row.result:3:hang"}  # results 1-2 are unit 0's; the rest never come


@pytest.fixture(scope="module")
def slow_args(tiny_model_dir, tmp_path_factory) -> list[str]:
    """Unit 0 (two rows, 2 tokens) commits first; the other rows need LONG tokens each."""
    rows = [{"id": i, "prompt": f"Tell a long story number {i}.", "max_tokens": 2 if i < 2 else LONG}
            for i in range(8)]
    path = write_prompts(tmp_path_factory.mktemp("slow") / "in.parquet", rows)
    return [f"input.path={path}", f"model.path={tiny_model_dir}", "sampling.ignore_eos=true",
            "output.rows_per_part=2", "engine.kv_cache_memory=32MiB", "progress.mode=off", "model.quant=none",
            f"runtime.grace_s={GRACE_S}"]


def test_sigterm_commits_finished_units_exits_75_in_grace_and_resume_completes(
        job_runner, slow_args, tmp_path):
    out = tmp_path / "out"
    pid, log = job_runner.start([*slow_args, f"output.path={out}"], HANG)
    wait_for(lambda: (out / "_progress" / "000000.json").exists(), timeout_s=600)

    # A second job on the same output fails before loading the model, naming the holder.
    rc, other = job_runner.run([*slow_args, f"output.path={out}"])
    assert rc == 73 and "output is in use by another job" in other and f"pid {pid}" in other
    assert "loaded" not in other

    os.kill(pid, signal.SIGTERM)
    rc = job_runner.wait(pid)
    assert rc == 75, log.read_text()
    assert f"interrupted: grace period of {GRACE_S:g}s spent" in log.read_text()

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
