"""One writer per output (or per shard of it): a lease file with an owner and a heartbeat.

Why: two jobs writing the same units would race on the same part names and ledger records. A job takes
the lease `_lease/<name>.json` before touching the output and renews it from a background thread; a
second job finds a live lease and stops at once with a message naming the holder. A lease whose heartbeat
is older than `output.lease_timeout_s` (the holder died or lost the network) is taken over; on the same
host a lease whose process is gone is taken over at once, so a restart after a crash does not wait.

Object stores have no atomic create-if-absent here, so acquisition is write-then-read-back after a short
settle delay, and every heartbeat re-reads the file: an owner that finds someone else's token has lost the
lease and is told through `on_lost` (the job then stops admitting work). Staleness compares the holder's
clock with ours: hosts sharing an output need roughly synchronised clocks (NTP), as usual on clusters.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import fsspec

from pipeline.errors import JobError
from pipeline.output.ledger import write_whole

log = logging.getLogger(__name__)

LEASE_DIR = "_lease"


class LeaseHeld(JobError):
    """Another live job owns this output (or an overlapping shard of it)."""


@dataclass(frozen=True)
class LeaseRecord:
    name: str
    num_shards: int
    token: str
    host: str
    pid: int
    started: float
    heartbeat: float

    def age(self, now: float) -> float:
        return now - self.heartbeat

    def alive(self, now: float, timeout_s: float) -> bool:
        if self.age(now) > timeout_s:
            return False
        if self.host == socket.gethostname() and self.pid != os.getpid():
            return _pid_alive(self.pid)
        return True

    def describe(self, now: float) -> str:
        return f"host {self.host}, pid {self.pid}, last heartbeat {self.age(now):.1f}s ago"


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
        return rec.name == self.name or rec.num_shards != self.num_shards

    # -- owning ------------------------------------------------------------------------------------------

    def _write(self) -> None:
        now = time.time()
        rec = LeaseRecord(self.name, self.num_shards, self.token, socket.gethostname(), os.getpid(),
                          self._started or now, now)
        write_whole(self.fs, self.path, json.dumps(asdict(rec)).encode(), "lease")

    def acquire(self) -> Lease:
        now = time.time()
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
            if path != self.path:
                self.fs.rm(path)
        self._started = now
        self.fs.makedirs(self.dir, exist_ok=True)
        self._write()
        time.sleep(self.settle_s)  # a racing writer that checked before our write shows up now
        rec = self._read(self.path)
        if rec is None or rec.token != self.token:
            holder = rec.describe(time.time()) if rec else "unknown"
            raise LeaseHeld(f"another job took the lease {self.path} at the same moment ({holder})")
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

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost is None:
            rec = self._read(self.path)
            if rec is not None and rec.token == self.token:
                self.fs.rm(self.path)

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
