"""The fence: epochs increase, a sealed writer's commits are refused, its successor's files stay as written."""

from __future__ import annotations

import json
import threading
import time
import uuid

import fsspec
import pytest

import pipeline.output.fence as fence_module
from pipeline.output.fence import Fence, Fenced
from pipeline.output.lease import Lease, LeaseHeld


def open_fence(url: str, name: str = "all", num_shards: int = 1) -> Fence:
    fs, root = fsspec.core.url_to_fs(url)
    fence = Fence(fs, f"{root}/_lease", name, num_shards, uuid.uuid4().hex)
    fence.open()
    return fence


def commit(fence: Fence, unit: str, data: bytes) -> None:
    """A unit's two files, as a job commits them: the part, then its ledger record."""
    root = fence.dir.removesuffix("/_lease/fence")
    with fence.commit(f"unit {unit}") as put:
        put(f"{root}/part-{unit}.parquet", data, "part")
        put(f"{root}/_progress/{unit}.json", b"record of " + data, "ledger")


def output(url: str) -> dict[str, bytes]:
    """Every file outside `_lease/`, by path relative to the output."""
    fs, root = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()
    return {p[len(root.rstrip("/")) + 1:]: fs.cat_file(p) for p in fs.find(root) if "/_lease/" not in p}


def fence_files(fence: Fence) -> list[str]:
    fence.fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fence.fs.ls(fence.dir, detail=False))


def test_epochs_increase_with_every_writer(output_url: str) -> None:
    epochs = []
    for _ in range(3):
        fence = open_fence(output_url)
        epochs.append(fence.epoch)
        fence.close()
    assert epochs == [1, 2, 3]


def test_a_sealed_writer_commits_nothing_and_its_successor_keeps_its_files(output_url: str) -> None:
    a = open_fence(output_url)
    commit(a, "000000", b"a0")
    b = open_fence(output_url)  # took over: seals epoch 1
    assert b.epoch == 2
    commit(b, "000001", b"b1")
    with pytest.raises(Fenced, match=r"not committing unit 000001: another job took over the lease at epoch 2 "
                                     r"\(this job had epoch 1\)"):
        commit(a, "000001", b"a1")
    assert output(output_url) == {"part-000000.parquet": b"a0", "_progress/000000.json": b"record of a0",
                                  "part-000001.parquet": b"b1", "_progress/000001.json": b"record of b1"}
    with pytest.raises(Fenced):  # and every later commit
        commit(a, "000002", b"a2")
    assert not [n for n in fence_files(a) if n.startswith("00000001-") and not n.endswith(".json")]  # no staged


def test_a_commit_claimed_before_the_seal_cannot_move_its_files_after_it(output_url: str, monkeypatch) -> None:
    """The writer is stopped between its claim and its moves (the fault point); its successor opens then."""
    a = open_fence(output_url)
    successor: list[Fence] = []

    def take_over(name: str) -> None:
        if name == "fence.claimed" and not successor:
            successor.append(open_fence(output_url))

    monkeypatch.setattr(fence_module, "fault_point", take_over)
    with pytest.raises(Fenced, match="another job took over the lease at epoch 2"):
        commit(a, "000000", b"a0")
    assert output(output_url) == {}  # not even the part: the seal swept what was staged
    commit(successor[0], "000000", b"b0")
    assert output(output_url) == {"part-000000.parquet": b"b0", "_progress/000000.json": b"record of b0"}


def test_shards_of_one_split_do_not_seal_each_other_but_another_split_seals_both(output_url: str) -> None:
    s0 = open_fence(output_url, "shard-00000-of-00002", 2)
    s1 = open_fence(output_url, "shard-00001-of-00002", 2)
    commit(s0, "000000", b"s0")
    commit(s1, "000001", b"s1")
    whole = open_fence(output_url)  # the whole output overlaps both shards
    for shard, unit in ((s0, "000002"), (s1, "000003")):
        with pytest.raises(Fenced, match="at epoch 3"):
            commit(shard, unit, b"late")
    commit(whole, "000002", b"w2")
    assert {n: d for n, d in output(output_url).items() if n.startswith("part-")} == {
        "part-000000.parquet": b"s0", "part-000001.parquet": b"s1", "part-000002.parquet": b"w2"}


def test_ended_epochs_leave_only_their_seal(output_url: str) -> None:
    a = open_fence(output_url)
    for unit in ("000000", "000001", "000002"):
        commit(a, unit, b"a")
    assert fence_files(a) == ["00000001-00000000.json", "00000001-00000003.json"]  # marker, last claim
    b = open_fence(output_url)  # seals epoch 1 at its slot 4
    assert fence_files(b) == ["00000001-00000003.json", "00000001-00000004.json", "00000002-00000000.json"]
    assert json.loads(b.fs.cat_file(f"{b.dir}/00000001-00000004.json")) == {"sealed_by": 2}
    b.close()
    assert fence_files(b) == ["00000001-00000003.json", "00000001-00000004.json", "00000002.released"]
    c = open_fence(output_url)  # epoch 3: the release note of epoch 2 is no longer needed
    assert c.epoch == 3 and fence_files(c) == [
        "00000001-00000003.json", "00000001-00000004.json", "00000003-00000000.json"]


def test_writers_opening_together_get_different_epochs(tmp_path) -> None:
    barrier, epochs = threading.Barrier(4), []

    def open_one(i: int) -> None:
        fs, root = fsspec.core.url_to_fs(str(tmp_path))
        fence = Fence(fs, f"{root}/_lease", f"shard-{i:05d}-of-00004", 4, uuid.uuid4().hex)
        barrier.wait()
        epochs.append(fence.open())

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(epochs) == [1, 2, 3, 4]


def test_a_lease_taken_over_from_a_frozen_holder_refuses_its_commits(output_url: str) -> None:
    """The holder stops renewing (its heartbeat thread never runs again) and its heartbeat ages past the
    timeout, as for a stopped process; the next job takes over, and the frozen one's commit is refused."""
    fs, root = fsspec.core.url_to_fs(output_url)
    frozen = Lease(fs, root, timeout_s=600, heartbeat_s=3600, settle_s=0.01).acquire()
    rec = json.loads(fs.cat_file(frozen.path))
    fs.pipe_file(frozen.path, json.dumps({**rec, "heartbeat": time.time() - 1200}).encode())  # 20 min frozen
    with Lease(fs, root, timeout_s=600, settle_s=0.01) as successor:
        assert json.loads(fs.cat_file(successor.path))["epoch"] == successor.fence.epoch == 2
        with successor.commit("unit 000000") as put:
            put(f"{root}/part-000000.parquet", b"new", "part")
        refused = "not committing unit 000000: another job took over the lease at epoch 2 \\(this job had epoch 1\\)"
        with pytest.raises(LeaseHeld, match=refused), frozen.commit("unit 000000") as put:
            put(f"{root}/part-000000.parquet", b"old", "part")
        frozen.release()  # a fenced holder leaves the lease file alone
        assert json.loads(fs.cat_file(successor.path))["token"] == successor.token
    assert fs.cat_file(f"{root}/part-000000.parquet") == b"new"
