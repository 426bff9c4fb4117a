"""`output.retry_errors=true`: a rerun redoes the error rows of committed units and nothing else.

The failure: with `engine.max_model_len` null the KV pool caps the model length, and `engine.kv_cache_memory`
is a speed setting outside the fingerprint. A first run with a small pool makes the long prompts error rows
("prompt has N tokens; max_model_len=256 ..."); the retry runs with a pool that holds them, as a rerun on a
machine with more memory would. Error rows have no prompt and sort first in their window, so once they run
they sort elsewhere: the units committed before keep their rows.
"""

from __future__ import annotations

import json
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output

pytestmark = pytest.mark.slow

LONG = (3, 10, 17)  # ids of the prompts too long for the small pool
SMALL, LARGE = "engine.kv_cache_memory=256KiB", "engine.kv_cache_memory=32MiB"  # 256 tokens; 2048 (all positions)
RETRY = "output.retry_errors=true"


@pytest.fixture
def args(tiny_model_dir, tmp_path) -> list[str]:
    """24 rows, 3 of them longer than 256 tokens (which sort among the others once they run); units of 4 rows."""
    words = " ".join(f"w{k}" for k in range(200))
    rows = [{"id": i, "prompt": f"Write one line about item {i}" + (f": {words}" if i in LONG else ".")}
            for i in range(24)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    return [f"input.path={tmp_path / 'in.parquet'}", f"model.path={tiny_model_dir}", "sampling.max_tokens=3",
            "output.rows_per_part=4", "engine.max_batch_size=8", "progress.mode=off", "model.quant=none"]


def run(job_runner, args: list[str], out, *extra: str, env: dict | None = None) -> str:
    rc, log = job_runner.run([*args, f"output.path={out}", *extra], env)
    assert rc == 0, log
    return log


def by_id(url) -> dict:
    rows = read_output(str(url))
    assert sorted(r["id"] for r in rows) == list(range(24))  # every row exactly once
    return {r["id"]: r for r in rows}


def metrics(out, name: str = "_metrics.json") -> dict:
    return json.loads((out / name).read_text())


def test_retry_redoes_the_error_rows_of_a_complete_output(job_runner, args, tmp_path):
    out = tmp_path / "out"
    run(job_runner, args, out, SMALL)
    before = by_id(out)
    assert sorted(i for i, r in before.items() if r["error"]) == list(LONG)
    assert all("max_model_len=256" in before[i]["error"] and before[i]["text"] is None for i in LONG)

    log = run(job_runner, args, out, LARGE, RETRY)
    assert "output.retry_errors: 3 error rows found in 6 committed units; 3 are retried" in log
    assert (metrics(out)["retried_error_rows"], metrics(out)["rows"], metrics(out)["error_rows"]) == (3, 3, 0)
    after = by_id(out)
    assert {i: r for i, r in after.items() if i not in LONG} == {i: r for i, r in before.items() if i not in LONG}
    assert all(after[i]["error"] is None and after[i]["text"] is not None for i in LONG)
    run(job_runner, args, tmp_path / "fresh", LARGE)
    fresh = by_id(tmp_path / "fresh")
    assert [after[i]["text"] for i in LONG] == [fresh[i]["text"] for i in LONG]  # what a run that fit wrote
    assert (out / "_SUCCESS").exists() and verify_output(str(out)).ok

    log = run(job_runner, args, out, LARGE, RETRY)  # nothing left to retry
    assert "0 error rows found in 6 committed units; 0 are retried" in log and "nothing to do" in log
    assert verify_output(str(out)).ok


def test_retry_over_a_partial_output_gives_every_row_once(job_runner, args, tmp_path):
    out = tmp_path / "out"
    rc, log = job_runner.run([*args, f"output.path={out}", SMALL], {"PIPELINE_FAULT": "ledger.after_write:1"})
    assert rc == -signal.SIGKILL, log
    (first,) = [json.loads(p.read_text()) for p in (out / "_progress").iterdir()]
    with open(out / first["part"], "rb") as f:
        committed = {r["id"]: r for r in pq.read_table(f).to_pylist()}
    assert sorted(i for i, r in committed.items() if r["error"]) == list(LONG)  # error rows sort first

    log = run(job_runner, args, out, LARGE, RETRY)
    assert "3 error rows found in 1 committed units; 3 are retried" in log
    after = by_id(out)
    assert all(r["error"] is None for r in after.values())
    assert all(after[i] == r for i, r in committed.items() if i not in LONG)  # the committed row, as it was
    run(job_runner, args, tmp_path / "fresh", LARGE)
    fresh = by_id(tmp_path / "fresh")
    assert {i: r["text"] for i, r in after.items()} == {i: r["text"] for i, r in fresh.items()}
    assert verify_output(str(out)).ok


def test_each_shard_retries_its_own_units(job_runner, args, tmp_path):
    out = tmp_path / "out"
    args = [*args, "plan.prefix_sort=false"]  # input order: the long rows in units 0, 2 and 4
    run(job_runner, args, out, SMALL)
    before = by_id(out)
    for shard, retried in ((0, 2), (1, 1)):  # units 0-2 and 3-5
        log = run(job_runner, args, out, LARGE, RETRY, "runtime.num_shards=2", f"runtime.shard_index={shard}")
        assert f"shard {shard}/2 output.retry_errors: {retried} error rows found in 3 committed units" in log
        assert metrics(out, f"_metrics-shard-0000{shard}-of-00002.json")["retried_error_rows"] == retried
    after = by_id(out)
    assert all(r["error"] is None for r in after.values())
    assert {i: r for i, r in after.items() if i not in LONG} == {i: r for i, r in before.items() if i not in LONG}
    assert (out / "_SUCCESS").exists() and verify_output(str(out)).ok


@pytest.mark.parametrize("point", ["part.mid_write:1", "part.after_write:1"])
def test_a_retry_killed_while_it_rewrites_a_part_is_finished_by_the_next_run(job_runner, args, tmp_path, point):
    """Killed before the new part is whole, the old part and record stand and the rerun retries again; killed
    after, the part no longer matches its record and the rerun redoes the unit whole, cut from its window
    beside the committed units as they hold their rows."""
    out = tmp_path / "out"
    run(job_runner, args, out, SMALL)
    rc, log = job_runner.run([*args, f"output.path={out}", LARGE, RETRY], {"PIPELINE_FAULT": point})
    assert rc == -signal.SIGKILL, log
    assert not (out / "_SUCCESS").exists()  # withdrawn while parts are rewritten
    log = run(job_runner, args, out, LARGE, RETRY)
    if point == "part.mid_write:1":
        assert "3 error rows found in 6 committed units; 3 are retried" in log
    else:
        assert "unit 000000 is redone: part part-000000.parquet has" in log
    assert all(r["error"] is None for r in by_id(out).values())
    assert (out / "_SUCCESS").exists() and verify_output(str(out)).ok
