"""One writer per output (or per shard of it): a lease file with an owner and a heartbeat.

Why: two jobs writing the same units would race on the same part names and ledger records. A job takes
the lease `_lease/<name>.json` before touching the output and renews it from a background thread; a
second job finds a live lease and stops at once with a message naming the holder. A lease whose heartbeat
is older than `output.lease_timeout_s` (the holder died or lost the network) is taken over; on the same
host a lease whose process is gone is taken over at once, so a restart after a crash does not wait.

The lease file is created exclusively, so of two jobs starting together exactly one gets it: on local
disk the record is written to a temp file and hard-linked to the lease name (`link` fails if the name
exists: an atomic create-if-absent whose content appears whole); on object stores a conditional PUT
(`If-None-Match: *`, fsspec's `mode="create"`). As a second line for stores that ignore the condition,
and after taking over a stale lease (delete + create is not atomic), the owner reads the file back after
a short settle delay. Every heartbeat re-reads the file too: an owner that finds someone else's token has
lost the lease and is told through `on_lost` (the job then stops admitting work). Staleness compares the holder's
clock with ours: hosts sharing an output need roughly synchronised clocks (NTP), as usual on clusters.

A lease is not a fence by itself: a holder frozen past the timeout (a stopped container, a paused VM) wakes
up believing it still holds it. So the holder also opens a fence epoch (fence.py), named in the lease file,
and commits every unit through `Lease.commit`: once another job took over, its commits are refused.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import JobError, LeaseHeld
from pipeline.faults import fault_point
from pipeline.output.exclusive import create_exclusive
from pipeline.output.fence import Fence, Fenced, overlaps
from pipeline.output.ledger import Put, write_whole

log = logging.getLogger(__name__)

LEASE_DIR = "_lease"


@dataclass(frozen=True)
class LeaseRecord:
    name: str
    num_shards: int
    token: str
    host: str
    pid: int
    started: float
    heartbeat: float
    epoch: int = 0  # the holder's fence epoch (0 until it has one)

    def age(self, now: float) -> float:
        return now - self.heartbeat

    def alive(self, now: float, timeout_s: float) -> bool:
        if self.age(now) > timeout_s:
            return False
        if self.host == socket.gethostname() and self.pid != os.getpid():
            return _pid_alive(self.pid)
        return True

    def describe(self, now: float) -> str:
        return f"host {self.host}, pid {self.pid}, epoch {self.epoch}, last heartbeat {self.age(now):.1f}s ago"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_name(num_shards: int, shard_index: int) -> str:
    return "all" if num_shards == 1 else f"shard-{shard_index:05d}-of-{num_shards:05d}"


class Lease:
    """Exclusive, heartbeated ownership of `<root>/_lease/<name>.json`. Use as a context manager."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        num_shards: int = 1,
        shard_index: int = 0,
        timeout_s: float = 60.0,
        heartbeat_s: float | None = None,
        settle_s: float = 0.2,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"output.lease_timeout_s must be > 0, got {timeout_s!r}")
        self.fs = fs
        self.dir = posixpath.join(root.rstrip("/"), LEASE_DIR)
        self.name = lease_name(num_shards, shard_index)
        self.path = posixpath.join(self.dir, f"{self.name}.json")
        self.num_shards = num_shards
        self.timeout_s = timeout_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else timeout_s / 4
        self.settle_s = settle_s
        self.on_lost = on_lost
        self.token = uuid.uuid4().hex
        self.fence = Fence(fs, self.dir, self.name, num_shards, self.token)
        self.lost: str | None = None
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading -----------------------------------------------------------------------------------------

    def _read(self, path: str) -> LeaseRecord | None:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        try:
            return LeaseRecord(**json.loads(data))
        except (ValueError, TypeError):
            log.warning("ignoring unreadable lease file %s", path)
            return None

    def _others(self) -> list[tuple[str, LeaseRecord]]:
        self.fs.invalidate_cache(self.dir)
        try:
            paths = [p for p in self.fs.ls(self.dir, detail=False) if p.endswith(".json")]
        except FileNotFoundError:
            return []
        out = []
        for p in paths:
            rec = self._read(p)
            if rec is not None and rec.token != self.token:
                out.append((p, rec))
        return out

    def _conflicts(self, rec: LeaseRecord) -> bool:
        """Same shard, or a different split of the same output (whose units overlap ours)."""
        return overlaps(rec.name, rec.num_shards, self.name, self.num_shards)

    # -- owning ------------------------------------------------------------------------------------------

    def _record(self) -> bytes:
        now = time.time()
        rec = LeaseRecord(self.name, self.num_shards, self.token, socket.gethostname(), os.getpid(),
                          self._started or now, now, self.fence.epoch)
        return json.dumps(asdict(rec)).encode()

    def _write(self) -> None:
        write_whole(self.fs, self.path, self._record(), "lease")

    def _create(self) -> bool:
        """Create the lease file only if it does not exist; False if it does (someone else has it)."""
        data = self._record()
        try:
            create_exclusive(self.fs, self.path, data)
        except FileExistsError:
            return False
        except OSError as e:
            raise JobError(f"cannot create the lease {self.path}: {e}") from None
        fault_point("lease.after_write")
        return True

    def _held_by_another(self, why: str) -> LeaseHeld:
        rec = self._read(self.path)
        holder = rec.describe(time.time()) if rec else "unknown"
        return LeaseHeld(f"another job took the lease {self.path} {why} ({holder})")

    def _check_others(self, now: float) -> bool:
        """Raise LeaseHeld if a live job holds a conflicting lease; delete stale ones. True if any was stale."""
        took_over = False
        for path, rec in self._others():
            if not self._conflicts(rec):
                continue
            if rec.alive(now, self.timeout_s):
                raise LeaseHeld(
                    f"output is in use by another job ({rec.describe(now)}; lease {path}). Wait for it to finish, "
                    f"or, if it is dead, for output.lease_timeout_s={self.timeout_s:g}s without heartbeat, "
                    "after which the lease is taken over"
                )
            log.warning("taking over stale lease %s (%s)", path, rec.describe(now))
            self.fs.rm(path)
            took_over = True
        return took_over

    def acquire(self) -> Lease:
        now = time.time()
        took_over = self._check_others(now)
        self._started = now
        self.fs.makedirs(self.dir, exist_ok=True)
        fault_point("lease.before_create")  # tests: another job starts between our check and our create
        if not self._create():
            raise self._held_by_another("at the same moment")
        if took_over or not isinstance(self.fs, LocalFileSystem):
            time.sleep(self.settle_s)  # a racing taker (or a store that ignores the condition) shows up now
            rec = self._read(self.path)
            if rec is None or rec.token != self.token:
                raise self._held_by_another("at the same moment")
        try:  # a job with another shard split may have created its own, conflicting lease meanwhile
            self._check_others(time.time())
            self.fence.open()  # seals the epochs of the writers whose leases were taken over
            self._write()  # the lease names its epoch
        except BaseException:
            self.fs.rm(self.path)
            raise
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                rec = self._read(self.path)
                if rec is None or rec.token != self.token:
                    holder = rec.describe(time.time()) if rec else "the lease file was deleted"
                    self.lost = f"lease {self.path} lost: {holder}"
                    log.error(self.lost)
                    if self.on_lost:
                        self.on_lost(self.lost)
                    return
                self._write()
            except Exception as e:  # a transient store error must not kill the thread; retry next beat
                log.warning("lease heartbeat on %s failed: %s", self.path, e)

    @contextmanager
    def commit(self, what: str) -> Iterator[Put]:
        """Write `what`'s files with the `Put` this yields, through the fence (`Fence.commit`): LeaseHeld if
        the lease is known to be lost, Fenced (and the lease lost) if another job took over."""
        if self.lost:
            raise LeaseHeld(f"not committing {what}: {self.lost}")
        try:
            with self.fence.commit(what) as put:
                yield put
        except Fenced as e:
            self.lost = str(e)
            raise

    def release(self) -> None:
        """Stop the heartbeat, end the fence epoch unless the lease was lost, and delete the lease file if it
        is still ours (a heartbeat write that a freeze cut short may have put it back after a takeover)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost is None:
            self.fence.close()
        rec = self._read(self.path)
        if rec is not None and rec.token == self.token:
            self.fs.rm(self.path)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
