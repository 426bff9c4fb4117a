"""task=score and task=embed killed at seeded points and resumed: every input row exactly once, with the
values of an uninterrupted run (up to float rounding: a resumed row may share its steps with other rows).

Real `python -m pipeline` processes on the tiny model (tests/output/zygote.py), killed by SIGKILL from inside
at named fault points (pipeline/faults.py): while the engine prefills other rows' candidates, between a
row's candidates' results, between a part and its ledger record, in the middle of a ledger write.
"""

from __future__ import annotations

import math
import random
import signal

import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output, write_prompts

pytestmark = pytest.mark.slow

# (fault point, range of the arrival that kills): 12 units of 2 rows, 3 candidates (requests) per score row
POINTS = [("row.admit", (2, 8)), ("row.result", (3, 12)), ("part.after_write", (1, 2)), ("ledger.mid_write", (1, 2)),
          ("row.result", (6, 15))]
CANDIDATES = [" yes", " no", " maybe so"]


@pytest.fixture(scope="module")
def task_args(tiny_model_dir, tmp_path_factory) -> list[str]:
    rows = [{"id": 500 + i, "prompt": f"Is statement number {i % 5} about {['cats', 'rain', 'maps'][i % 3]} true?",
             "candidates": CANDIDATES[i % 3:] + CANDIDATES[: i % 3]} for i in range(24)]
    path = write_prompts(tmp_path_factory.mktemp("task-input") / "in.parquet", rows)
    return [f"input.path={path}", f"model.path={tiny_model_dir}", "output.rows_per_part=2",
            "engine.kv_cache_memory=32MiB", "engine.max_batch_size=8", "progress.mode=off", "model.quant=none"]


def crash_and_resume(job_runner, args: list[str], seed: int) -> None:
    rng = random.Random(seed)
    for point, (lo, hi) in POINTS:
        n = rng.randint(lo, hi)
        rc, log = job_runner.run(args, {"PIPELINE_FAULT": f"{point}:{n}"})
        assert rc == -signal.SIGKILL, f"{point}:{n} was not reached (rc {rc}):\n{log}"
    rc, log = job_runner.run(args)
    assert rc == 0, log


def values(row: dict) -> list[float]:
    """A row's numbers: its candidates' log-probability sums, or its embedding."""
    return [s["logprob_sum"] for s in row["scores"]] if "scores" in row else row["embedding"]


@pytest.mark.parametrize("task", ["task=score", "task=embed"])
def test_killed_and_resumed_writes_every_row_once_with_the_uninterrupted_values(job_runner, task_args, tmp_path,
                                                                                task):
    reference = tmp_path / "reference"
    rc, log = job_runner.run([*task_args, task, f"output.path={reference}"])
    assert rc == 0, log
    want = {r["id"]: r for r in read_output(str(reference))}
    out = tmp_path / "out"
    crash_and_resume(job_runner, [*task_args, task, f"output.path={out}"], seed=3)
    got = read_output(str(out))
    assert [r["id"] for r in got] == list(range(500, 524))  # each input row once
    for row in got:
        expected = want[row["id"]]
        assert row["error"] is None and row["prompt_tokens"] == expected["prompt_tokens"]
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(values(row), values(expected), strict=True))
        if task == "task=score":
            assert row["best_candidate"] == expected["best_candidate"]
    report = verify_output(str(out))
    assert report.ok and report.rows == 24, report.errors
    assert (out / "_SUCCESS").exists()
