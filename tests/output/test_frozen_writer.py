"""A writer frozen past its lease timeout (SIGSTOP) wakes up after another job took over and finished.

Whole runs of the tiny model (48 rows in 24 units of 2, tests/output/zygote.py). The first job stands at a
named fault point of its third commit (`wait=`: until a file appears), is stopped there with SIGSTOP, and
stays stopped until its lease is older than `output.lease_timeout_s`; a second job takes the lease over and
finishes; then the first goes on. Its commit must be refused with one line naming the new epoch (exit 73),
and the output must be exactly the second job's: every row once, `verify` passing, no file changed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import fsspec
import pytest

from pipeline.output.verify import verify_output
from tests.output.jobs import read_output, wait_for

pytestmark = pytest.mark.slow

TIMEOUT_S = 1.0  # output.lease_timeout_s of both jobs


def state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: exited, not yet waited for)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def reaches_the_point(pid: int, log: Path) -> bool:
    """The job prints that it waits at the fault point; fails with its log if it ended instead."""
    text = log.read_text() if log.exists() else ""
    assert state(pid) != "Z", text
    return "waiting" in text


def files(url: str) -> dict[str, bytes]:
    """The output's files outside `_lease/`, by path."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p: fs.cat_file(p) for p in fs.find(root) if "/_lease/" not in p}


@pytest.mark.parametrize(("where", "point"), [
    ("local", "part.before_write"),  # nothing of the unit written yet
    ("local", "fence.claimed"),  # its slot claimed, its files staged, not moved into place
    ("s3", "fence.claimed"),
])
def test_a_frozen_writer_cannot_commit_over_its_successor(where, point, job_runner, job_args, tmp_path, request):
    out = str(tmp_path / "out") if where == "local" else f"{request.getfixturevalue('s3_bucket')}/out"
    go = tmp_path / "go"
    args = [*job_args, f"output.path={out}", f"output.lease_timeout_s={TIMEOUT_S}"]
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}  # the moto server's address
    pid, log = job_runner.start(args, {**env, "PIPELINE_FAULT": f"{point}:3:wait={go}"})
    try:
        wait_for(lambda: reaches_the_point(pid, log), timeout_s=600)
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: state(pid) == "T")
        fs, root = fsspec.core.url_to_fs(out)
        lease = json.loads(fs.cat_file(f"{root}/_lease/all.json"))
        assert lease["epoch"] == 1
        wait_for(lambda: time.time() - lease["heartbeat"] > TIMEOUT_S)  # stale for the second job too
        rc, second = job_runner.run(args, env)
        assert rc == 0, second
        assert "taking over stale lease" in second and "24 units (48 rows), 2 already committed, 22 to do" in second
        successor = files(out)
    finally:
        go.touch()
        os.kill(pid, signal.SIGCONT)
        rc = job_runner.wait(pid)
    first = log.read_text()
    assert rc == 73, first
    refused = re.findall(r"^error: .*$", first, re.M)
    assert len(refused) == 1 and re.fullmatch(
        r"error: not committing unit \d{6}: another job took over the lease at epoch 2 \(this job had epoch 1\); "
        r"the output keeps that job's work", refused[0]), first
    assert files(out) == successor  # nothing the second job wrote changed
    assert [(r["id"], r["sample_index"]) for r in read_output(out)] == [(i, 0) for i in range(1000, 1048)]
    report = verify_output(out)
    assert report.ok and report.rows == 48, report.errors
