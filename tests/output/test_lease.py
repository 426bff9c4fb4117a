"""Leases: one live writer per output or shard; stale leases are taken over; a lost lease is noticed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import fsspec
import pytest

from pipeline.output.lease import Lease, LeaseHeld
from tests.output.jobs import wait_for


def fs_root(url: str):
    return fsspec.core.url_to_fs(url)


def write_foreign(fs, root: str, name: str, *, host: str, pid: int, age_s: float, num_shards: int = 1) -> None:
    now = time.time()
    rec = {"name": name, "num_shards": num_shards, "token": "other", "host": host, "pid": pid,
           "started": now - age_s, "heartbeat": now - age_s}
    fs.makedirs(f"{root}/_lease", exist_ok=True)
    fs.pipe_file(f"{root}/_lease/{name}.json", json.dumps(rec).encode())


def test_second_writer_fails_fast_with_the_holder(output_url: str) -> None:
    fs, root = fs_root(output_url)
    with Lease(fs, root, timeout_s=30, settle_s=0.01):
        with pytest.raises(LeaseHeld) as err:
            Lease(fs, root, timeout_s=30, settle_s=0.01).acquire()
        assert f"host {socket.gethostname()}" in str(err.value) and "lease_timeout_s=30s" in str(err.value)
    assert not fs.exists(f"{root}/_lease/all.json")  # released
    with Lease(fs, root, timeout_s=30, settle_s=0.01):
        pass


def test_shards_do_not_conflict_but_different_splits_do(output_url: str) -> None:
    fs, root = fs_root(output_url)
    with Lease(fs, root, 4, 0, settle_s=0.01), Lease(fs, root, 4, 1, settle_s=0.01):
        with pytest.raises(LeaseHeld):
            Lease(fs, root, 4, 1, settle_s=0.01).acquire()
        with pytest.raises(LeaseHeld):
            Lease(fs, root, 2, 1, settle_s=0.01).acquire()  # a 2-way split overlaps the 4-way one
        with pytest.raises(LeaseHeld):
            Lease(fs, root, settle_s=0.01).acquire()  # the whole output overlaps every shard


def test_stale_lease_of_another_host_is_taken_over(output_url: str) -> None:
    fs, root = fs_root(output_url)
    write_foreign(fs, root, "all", host="elsewhere", pid=1, age_s=5)
    with pytest.raises(LeaseHeld, match="host elsewhere"):
        Lease(fs, root, timeout_s=10, settle_s=0.01).acquire()
    with Lease(fs, root, timeout_s=4, settle_s=0.01) as lease:  # 5 s without heartbeat > 4 s timeout
        assert json.loads(fs.cat_file(lease.path))["token"] == lease.token


def test_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    fs, root = fs_root(str(tmp_path))
    write_foreign(fs, root, "all", host=socket.gethostname(), pid=dead.pid, age_s=0)
    with Lease(fs, root, timeout_s=600, settle_s=0.01):
        pass


def test_heartbeat_renews_and_detects_loss(output_url: str) -> None:
    fs, root = fs_root(output_url)
    lost = threading.Event()
    lease = Lease(fs, root, timeout_s=1, heartbeat_s=0.05, settle_s=0.01, on_lost=lambda why: lost.set())
    with lease:
        first = json.loads(fs.cat_file(lease.path))["heartbeat"]
        wait_for(lambda: json.loads(fs.cat_file(lease.path))["heartbeat"] > first, timeout_s=10)
        # Someone takes it over. A heartbeat already between its read and its write can overwrite the
        # taker once (the taker's read-back then fails and it would retry): retry like a taker would.
        for _ in range(20):
            write_foreign(fs, root, "all", host="thief", pid=1, age_s=0)
            if lost.wait(1):
                break
        assert lost.is_set() and "thief" in lease.lost
    assert json.loads(fs.cat_file(lease.path))["token"] == "other"  # a lost lease is not deleted


def test_concurrent_acquire_has_exactly_one_winner(output_url: str) -> None:
    fs, root = fs_root(output_url)
    barrier, tried = threading.Barrier(2), threading.Barrier(2)
    outcome: list[str] = []

    def contend() -> None:
        lease = Lease(fs, root, timeout_s=30, settle_s=0.3)
        barrier.wait()
        try:
            lease.acquire()
            outcome.append("won")
            tried.wait()  # the winner holds the lease until the other has tried, however slow it is
            lease.release()
        except LeaseHeld:
            outcome.append("lost")
            tried.wait()

    threads = [threading.Thread(target=contend) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcome) == ["lost", "won"]


def test_a_job_delayed_between_its_check_and_its_create_does_not_take_a_held_lease(output_url, monkeypatch):
    """Job A checks (no lease), then stalls before creating its lease file; job B takes the lease meanwhile.
    Before, A's later write replaced B's (and with a rename delayed past the settle time both ran)."""
    import pipeline.output.lease as lease_module

    fs, root = fs_root(output_url)
    a_checked, b_done = threading.Event(), threading.Event()

    def stall_a(name: str) -> None:
        if name == "lease.before_create" and threading.current_thread().name == "job-a":
            a_checked.set()
            b_done.wait()  # the injected delay: as long as B needs

    monkeypatch.setattr(lease_module, "fault_point", stall_a)
    outcome: list[BaseException | str] = []

    def job_a() -> None:
        try:
            Lease(fs, root, timeout_s=30, settle_s=0.01).acquire()
            outcome.append("won")
        except LeaseHeld as e:
            outcome.append(e)

    thread = threading.Thread(target=job_a, name="job-a")
    thread.start()
    assert a_checked.wait(60)
    b = Lease(fs, root, timeout_s=30, settle_s=0.01).acquire()
    b_done.set()
    thread.join()
    try:
        assert len(outcome) == 1 and isinstance(outcome[0], LeaseHeld), outcome
        assert "another job took the lease" in str(outcome[0])
        assert json.loads(fs.cat_file(b.path))["token"] == b.token  # B's lease is intact
    finally:
        b.release()


def test_timeout_must_be_positive(tmp_path) -> None:
    with pytest.raises(ValueError, match="output.lease_timeout_s"):
        Lease(fsspec.filesystem("file"), str(tmp_path), timeout_s=0)
