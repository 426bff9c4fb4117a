"""create_exclusive: of several creators of one name exactly one wins, and the file appears whole."""

from __future__ import annotations

import errno
import threading

import fsspec
import pytest

from pipeline.output import exclusive
from pipeline.output.exclusive import create_exclusive


def test_only_the_first_create_of_a_name_succeeds(output_url: str) -> None:
    fs, root = fsspec.core.url_to_fs(output_url)
    fs.makedirs(root, exist_ok=True)
    create_exclusive(fs, f"{root}/a.json", b"first")
    with pytest.raises(FileExistsError):
        create_exclusive(fs, f"{root}/a.json", b"second")
    assert fs.cat_file(f"{root}/a.json") == b"first"


def test_concurrent_creates_have_one_winner(tmp_path) -> None:
    fs, path = fsspec.filesystem("file"), str(tmp_path / "a.json")
    barrier, won = threading.Barrier(8), []

    def create(i: int) -> None:
        barrier.wait()
        try:
            create_exclusive(fs, path, str(i).encode())
            won.append(i)
        except FileExistsError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and (tmp_path / "a.json").read_bytes() == str(won[0]).encode()
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temp file left


def test_exclusive_create_without_hard_links(tmp_path, monkeypatch) -> None:
    """Where the filesystem has no hard links, O_EXCL still lets exactly one creator win."""

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(exclusive.os, "link", no_links)
    path = str(tmp_path / "all.json")
    exclusive.create_local(path, b"first")
    with pytest.raises(FileExistsError):
        exclusive.create_local(path, b"second")
    assert (tmp_path / "all.json").read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == [
        "all.json"]
