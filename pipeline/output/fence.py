"""Fencing tokens for the output's writers: a writer whose lease was taken over can commit nothing more.

Why: a lease (lease.py) is taken over once its holder stops renewing it for `output.lease_timeout_s`, also
when the holder is only frozen (a stopped container, a paused VM). A frozen writer wakes up in the middle of
whatever it was doing; unfenced, it could write one unit over its successor's work. So each lease holder
gets an *epoch*, higher than that of any writer that may still be alive, and commits every unit through its
fence:

1. the unit's files (its part, then its ledger record) are staged under names of their own in the fence
   folder;
2. the writer claims the next slot of its epoch: an exclusive create (exclusive.py), the conditional write;
3. only then are the staged files moved into place, in order (the ledger record last: the commit point).

A writer that takes over *seals* every open epoch of a writer whose shard overlaps its own: it creates the
slot that epoch's next commit would claim (the next free one, should that writer claim one meanwhile), so
the claim fails; then it deletes the epoch's staged files, so that a commit which claimed its slot before
the seal has nothing left to move. What the sealed writer had moved into place is in the output when its
successor reads the ledger, after sealing. A sealed writer stops with `Fenced` (exit 73).

The fence folder `_lease/fence/` (E an epoch, k a slot, 8 digits each):
- `E-00000000.json`: epoch E is open (its lease name, shard split and token); sealing or release removes it;
- `E-k.json`, k >= 1: E's claim for its k-th commit, or a seal (`{"sealed_by": N}`); a writer deletes its
  claim k - 1 once it holds k, seals stay (one small file per takeover);
- `E-k.<i>.<name>`: the i-th file staged for E's k-th commit, to be moved to `<name>` in the output;
- `E.released`: E ended normally; kept until a later epoch opens, so that epochs keep increasing.

Moves are `os.replace` on local disk (atomic) and a copy and a delete on object stores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import re
from collections.abc import Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import JobError, LeaseHeld
from pipeline.faults import fault_point
from pipeline.output.exclusive import create_exclusive
from pipeline.output.ledger import Put, write_whole

log = logging.getLogger(__name__)

FENCE_DIR = "fence"
_EPOCH = re.compile(r"\.?(\d{8})[-.]")  # every name in the folder starts with its epoch
_SLOT = re.compile(r"(\d{8})-(\d{8})\.json")
# What a seal or a release sweeps: staged files and `write_whole`'s temp files of them, the marker, `E.released`.
_SWEPT = re.compile(r"\.?\d{8}-\d{8}\.\d+\..+|\d{8}-00000000\.json|\d{8}\.released")


class Fenced(LeaseHeld):
    """A newer writer sealed this writer's epoch: it commits nothing more."""


def overlaps(name: str, num_shards: int, other_name: str, other_num_shards: int) -> bool:
    """Two leases cover common units: the same shard, or different splits of the output."""
    return name == other_name or num_shards != other_num_shards


class Fence:
    """The epochs of the writers of one output: this writer's, and sealing those it took over."""

    def __init__(self, fs: fsspec.AbstractFileSystem, lease_dir: str, name: str, num_shards: int,
                 token: str) -> None:
        self.fs = fs
        self.dir = posixpath.join(lease_dir, FENCE_DIR)
        self.name = name
        self.num_shards = num_shards
        self.token = token
        self.epoch = 0
        self.seq = 0  # the last slot this epoch claimed

    def _path(self, name: str) -> str:
        return posixpath.join(self.dir, name)

    def _slot(self, epoch: int, k: int) -> str:
        return self._path(f"{epoch:08d}-{k:08d}.json")

    def _names(self) -> list[str]:
        self.fs.invalidate_cache(self.dir)
        try:
            return [posixpath.basename(p) for p in self.fs.ls(self.dir, detail=False)]
        except FileNotFoundError:
            return []

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    # -- epochs ------------------------------------------------------------------------------------------

    def open(self) -> int:
        """Take an epoch higher than any in the folder, seal the open epochs of overlapping writers (the
        caller holds the lease, so none of them is live) and sweep what ended epochs left; returns it."""
        self.fs.makedirs(self.dir, exist_ok=True)
        marker = json.dumps({"name": self.name, "num_shards": self.num_shards, "token": self.token}).encode()
        while True:
            names = self._names()
            epoch = 1 + max((int(m[1]) for n in names if (m := _EPOCH.match(n))), default=0)
            try:
                create_exclusive(self.fs, self._slot(epoch, 0), marker)
                break
            except FileExistsError:  # another writer opened this epoch first: take the next
                continue
        self.epoch, self.seq = epoch, 0
        older = sorted({int(m[1]) for n in names if (m := _EPOCH.match(n)) and int(m[1]) < epoch})
        for e in older:
            marker_name = posixpath.basename(self._slot(e, 0))
            if marker_name not in names:
                self._sweep(e, names)  # sealed or released: only its seal stays
            elif self._overlaps(e):
                self._seal(e)
        return epoch

    def _overlaps(self, epoch: int) -> bool:
        try:
            rec = json.loads(self.fs.cat_file(self._slot(epoch, 0)))
            return overlaps(rec["name"], rec["num_shards"], self.name, self.num_shards)
        except FileNotFoundError:  # sealed or released meanwhile
            return False
        except (ValueError, KeyError, TypeError):  # unreadable: seal it rather than trust it
            return True

    def _seal(self, epoch: int) -> None:
        """Create the slot `epoch`'s next commit would claim, then sweep its staged files and marker."""
        k = max((int(m[2]) for n in self._names() if (m := _SLOT.fullmatch(n)) and int(m[1]) == epoch), default=0)
        seal = json.dumps({"sealed_by": self.epoch}).encode()
        while True:
            k += 1
            try:
                create_exclusive(self.fs, self._slot(epoch, k), seal)
                break
            except FileExistsError:  # its writer claimed slot k just now: seal the next one
                continue
        log.warning("sealed epoch %d of lease %s: that writer's commits are refused from now on", epoch, self.name)
        self._sweep(epoch, self._names())

    def _sweep(self, epoch: int, names: list[str]) -> None:
        """Delete an ended epoch's staged files, marker and release note (its marker last); seals stay."""
        doomed = [n for n in names if _SWEPT.fullmatch(n) and int(_EPOCH.match(n)[1]) == epoch]
        for name in sorted(doomed, key=lambda n: n.endswith("-00000000.json")):
            self._remove(self._path(name))

    def close(self) -> None:
        """End this epoch normally, after its last commit: drop its claim and marker, leave `E.released`."""
        self.fs.pipe_file(self._path(f"{self.epoch:08d}.released"), b"")
        if self.seq:
            self._remove(self._slot(self.epoch, self.seq))
        self._remove(self._slot(self.epoch, 0))

    # -- commits -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def commit(self, what: str) -> Iterator[Put]:
        """Stage `what`'s files with the `Put` this yields; when the block ends, claim the next slot and move
        them into place in the order they were put. Fenced if this epoch was sealed (nothing moved, or, for a
        commit whose claim came before the seal, at most its first files: no ledger record, no commit).
        Fault points: each file's `before_write` and `mid_write` while it is staged, `fence.claimed`, then
        its `after_write` once it is in its place (so they mean what they mean for `write_whole`)."""
        k = self.seq + 1
        moves: list[tuple[str, str, str]] = []  # (staged, final, fault point)

        def stage(path: str, data: bytes, point: str) -> None:
            staged = self._path(f"{self.epoch:08d}-{k:08d}.{len(moves)}.{posixpath.basename(path)}")
            write_whole(self.fs, staged, data, point, staged=True)
            moves.append((staged, path, point))

        try:
            yield stage
            self._claim(k, what, [final for _, final, _ in moves])
            fault_point("fence.claimed")
            for staged, final, point in moves:
                self._move(staged, final, what, k)
                fault_point(f"{point}.after_write")  # as for `write_whole`: the file is in its place
        except BaseException:
            for staged, _, _ in moves:
                self._remove(staged)
            raise
        if k > 1:
            self._remove(self._slot(self.epoch, k - 1))
        self.seq = k

    def _claim(self, k: int, what: str, files: list[str]) -> None:
        try:
            create_exclusive(self.fs, self._slot(self.epoch, k), json.dumps({"commit": what, "files": files}).encode())
        except FileExistsError:
            raise self._fenced(what, k) from None

    def _move(self, staged: str, final: str, what: str, k: int) -> None:
        try:
            if isinstance(self.fs, LocalFileSystem):
                os.makedirs(posixpath.dirname(final), exist_ok=True)
                os.replace(staged, final)
            else:
                self.fs.copy(staged, final)
                self._remove(staged)
        except FileNotFoundError:  # a seal swept it: the sealing writer put its seal after claim k
            raise self._fenced(what, k + 1) from None
        except OSError as e:
            raise JobError(f"cannot write {final}: {e.strerror or e}") from None

    def _fenced(self, what: str, k: int) -> Fenced:
        """The error for a commit refused by the seal in slot `k` of this epoch."""
        try:
            by = json.loads(self.fs.cat_file(self._slot(self.epoch, k)))["sealed_by"]
        except (OSError, ValueError, KeyError, TypeError):
            by = None
        at = f" at epoch {by}" if by is not None else ""
        return Fenced(f"not committing {what}: another job took over the lease{at} (this job had epoch "
                      f"{self.epoch}); the output keeps that job's work")
