"""Commit protocol for output parts: every unit is written exactly once, whatever kills the job.

Why: a batch job on preemptible machines dies at arbitrary instants. The protocol makes each unit's
output appear atomically and records it only afterwards:

1. the unit's part (Parquet or JSON Lines) appears whole under its final name (`write_whole`: local disk:
   temp file + fsync + rename; object store: one PUT of the final key, visible all at once; in a job, the
   lease's fence stages it so and moves it into place once the writer's claim succeeded: fence.py);
2. then the ledger record `_progress/<unit>.json` (row count, checksum of the ids, part name and size, and
   the digests of the input rows the unit was planned from: pipeline/plan/digests.py) appears the same
   way. **The record is the commit point.**

A part without a record is an interrupted attempt: it is never read as a result and is overwritten when
the unit is redone (unit ids, hence part names, are stable). `verify` re-reads every part and checks it
against its record; `_SUCCESS` is written once every unit of the plan is committed.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from pipeline.errors import JobError
from pipeline.faults import fault_point
from pipeline.output import jsonl_rows

PART_PREFIX = "part-"
PART_SUFFIXES = (".parquet", ".jsonl")  # Parquet parts; JSON Lines parts (output.format=jsonl, openai_batch)
_TEMP_NAME = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")  # `write_whole`'s temp files
PROGRESS_DIR = "_progress"
# Writes `data` whole at a path, `point` naming its fault points: `write_whole` on a filesystem, or the `put`
# of a fenced commit (pipeline/output/fence.py), which stages the file and moves it into place once allowed.
Put = Callable[[str, bytes, str], None]
SUCCESS_FILE = "_SUCCESS"
# A part's key-value metadata: the input rows it holds (JSON list, in part order, each one's index in the
# whole input in listing order), so a later run knows them even when the planned order has changed since.
INPUT_ROWS_KEY = "pipeline.input_rows"


def part_name(unit_id: str, suffix: str = ".parquet") -> str:
    return f"{PART_PREFIX}{unit_id}{suffix}"


def ids_checksum(ids: Iterable[Any]) -> str:
    """Order-independent, multiplicity-sensitive checksum of a unit's ids (results arrive in any order)."""
    canon = sorted(json.dumps(i, sort_keys=True, default=str) for i in ids)
    return hashlib.sha256("\n".join(canon).encode()).hexdigest()


@dataclass(frozen=True)
class CommitRecord:
    """What the ledger knows about one committed unit."""

    unit: str
    part: str
    rows: int
    ids_sha256: str
    bytes: int
    committed_at: float = field(default=0.0, compare=False)
    # input file name -> sha256 of its rows in the unit's window; None in records written before row digests
    input_sha256: dict[str, str] | None = None
    # the part's input rows (`INPUT_ROWS_KEY`) where the part cannot hold them itself (JSON Lines); else None
    input_rows: list[int] | None = None

    @classmethod
    def from_json(cls, data: bytes, where: str) -> CommitRecord:
        try:
            raw = json.loads(data)
            return cls(**{k: raw[k] for k in ("unit", "part", "rows", "ids_sha256", "bytes", "committed_at")},
                       input_sha256=raw.get("input_sha256"), input_rows=raw.get("input_rows"))
        except (ValueError, KeyError, TypeError) as e:
            raise LedgerError(f"unreadable ledger record {where}: {e}") from None


class LedgerError(RuntimeError):
    """The ledger or a part is inconsistent; names the file."""


@dataclass
class VerifyReport:
    """Outcome of `Ledger.verify`: `errors` mean the output cannot be trusted; `notes` are harmless leftovers."""

    committed_units: int = 0
    rows: int = 0
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def write_whole(fs: fsspec.AbstractFileSystem, path: str, data: bytes, point: str, staged: bool = False) -> None:
    """Make `data` appear at `path` all at once: no reader ever sees a partial file under the final name.

    `point` names the fault-injection points `<point>.before_write|mid_write|after_write` (see faults.py).
    `staged`: `path` is a staging name (fence.py), whose mover passes `<point>.after_write` once the file
    is in its place.
    """
    try:
        _write_whole(fs, path, data, point, staged)
    except OSError as e:  # read-only, full disk, no permission: name the file and the cause
        raise JobError(f"cannot write {path}: {e.strerror or e}") from None


def _write_whole(fs: fsspec.AbstractFileSystem, path: str, data: bytes, point: str, staged: bool) -> None:
    fault_point(f"{point}.before_write")
    if isinstance(fs, LocalFileSystem):
        directory, name = posixpath.split(path)
        os.makedirs(directory, exist_ok=True)
        tmp = posixpath.join(directory, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(tmp, "wb") as f:
            half = len(data) // 2
            f.write(data[:half])
            f.flush()
            fault_point(f"{point}.mid_write")
            f.write(data[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    else:
        fault_point(f"{point}.mid_write")
        fs.pipe_file(path, data)  # one PUT (a multipart upload is also only visible once completed)
    if not staged:
        fault_point(f"{point}.after_write")


class Ledger:
    """Parts and ledger records under one output root (any fsspec filesystem)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")

    def path(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def record_path(self, unit_id: str) -> str:
        return self.path(PROGRESS_DIR, f"{unit_id}.json")

    def commit(self, unit_id: str, part: str, nbytes: int, ids: Sequence[Any],
               input_sha256: dict[str, str] | None = None, put: Put | None = None,
               input_rows: list[int] | None = None) -> CommitRecord:
        """Record a part that was just written whole (`write_whole`): this record is the commit point.

        `ids` are the part's id column, one per row; `input_sha256` the digests of the unit's window
        (`WindowDigests`); `put` writes the record (a job's fenced commit, pipeline/output/fence.py;
        `write_whole` without one). Re-committing a unit overwrites its record.
        """
        record = CommitRecord(unit=unit_id, part=part, rows=len(ids), ids_sha256=ids_checksum(ids),
                              bytes=nbytes, committed_at=time.time(), input_sha256=input_sha256,
                              input_rows=input_rows)
        data = json.dumps(asdict(record)).encode()
        if put is None:
            write_whole(self.fs, self.record_path(unit_id), data, "ledger")
        else:
            put(self.record_path(unit_id), data, "ledger")
        return record

    def committed(self) -> dict[str, CommitRecord]:
        """All committed units, read in one batched call (concurrent GETs on object stores)."""
        return self.records()[0]

    def records(self) -> tuple[dict[str, CommitRecord], dict[str, str]]:
        """The committed units, and the unreadable record files (unit id -> why), which commit nothing."""
        self.fs.invalidate_cache(self.path(PROGRESS_DIR))
        try:
            paths = [p for p in self.fs.ls(self.path(PROGRESS_DIR), detail=False) if p.endswith(".json")]
        except FileNotFoundError:
            return {}, {}
        if not paths:
            return {}, {}
        blobs = self.fs.cat(paths, on_error="return")
        records, unreadable = {}, {}
        for p in paths:
            try:
                if isinstance(blobs[p], Exception):
                    raise LedgerError(f"unreadable ledger record {p}: {blobs[p]}")
                rec = CommitRecord.from_json(blobs[p], p)
            except LedgerError as e:
                unreadable[posixpath.basename(p)[: -len(".json")]] = str(e)
                continue
            records[rec.unit] = rec
        return records, unreadable

    def damaged(self, records: Mapping[str, CommitRecord]) -> dict[str, str]:
        """Committed units whose part is missing or not the size its record says (unit -> why).

        One listing of the output folder, no part is read: cheap enough for every start."""
        self.fs.invalidate_cache(self.root)
        try:
            sizes = {posixpath.basename(i["name"]): i.get("size") for i in self.fs.ls(self.root, detail=True)}
        except FileNotFoundError:
            sizes = {}
        out = {}
        for unit, rec in records.items():
            if rec.part not in sizes:
                out[unit] = f"part {rec.part} is missing"
            elif sizes[rec.part] != rec.bytes:
                out[unit] = f"part {rec.part} has {sizes[rec.part]} bytes, its ledger record says {rec.bytes}"
        return out

    def read_part(self, part: str, columns: Sequence[str] | None = None) -> tuple[pa.Table, list[int] | None]:
        """A part's rows (only `columns`; `[]` reads the footer alone) and the input rows it holds (None
        for a part written before parts recorded them)."""
        try:
            # One thread, no dataset layer: fewer Arrow pool tasks left holding this Python file (see
            # pipeline.verify's exit).
            with self.fs.open(self.path(part), "rb") as f:
                table = pq.ParquetFile(f).read(columns=columns, use_threads=False)
        except (pa.ArrowException, OSError) as e:
            raise LedgerError(f"part {part} is unreadable: {e} (delete it to have its unit redone)") from None
        rows = (table.schema.metadata or {}).get(INPUT_ROWS_KEY.encode())
        return table, None if rows is None else json.loads(rows)

    def part_rows(self, part: str, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """A part's records (only `columns`), Parquet or JSON Lines."""
        if part.endswith(".parquet"):
            return self.read_part(part, columns)[0].to_pylist()
        try:
            return jsonl_rows.decode(self.fs.cat_file(self.path(part)), columns)
        except (ValueError, OSError) as e:
            raise LedgerError(f"part {part} is unreadable: {e} (delete it to have its unit redone)") from None

    def part_input_rows(self, record: CommitRecord) -> list[int] | None:
        """The input rows a committed part holds: its record's, else its Parquet footer's (None for a part
        written before parts recorded them)."""
        if record.input_rows is not None or not record.part.endswith(".parquet"):
            return record.input_rows
        return self.read_part(record.part, [])[1]

    def withdraw_success(self) -> None:
        if self.is_complete():
            self.fs.rm(self.path(SUCCESS_FILE))

    def uncommit(self, unit_id: str) -> None:
        """Drop a unit's record (its part is damaged): the unit is to do again."""
        self.fs.rm(self.record_path(unit_id))

    def is_complete(self) -> bool:
        self.fs.invalidate_cache(self.root)
        return self.fs.exists(self.path(SUCCESS_FILE))

    def mark_success(self, expected_units: Sequence[str]) -> bool:
        """Write `_SUCCESS` if every expected unit is committed (any shard may call this; it is idempotent)."""
        done = self.committed()
        if any(u not in done for u in expected_units) or self.damaged(done):
            return False
        write_whole(self.fs, self.path(SUCCESS_FILE), b"", "success")
        return True

    def remove_leftovers(self, unit_ids: Iterable[str], everything: bool = False) -> None:
        """Delete temp files of interrupted writes for these units (only ours: other shards may be writing),
        or, with `everything` (the caller holds the whole output), every temp file `write_whole` left."""
        if not isinstance(self.fs, LocalFileSystem):
            return  # object stores never hold partial objects under any name
        unit_ids = list(unit_ids)
        wanted = {f".{part_name(u, s)}.tmp-" for u in unit_ids for s in PART_SUFFIXES}
        wanted |= {f".{u}.json.tmp-" for u in unit_ids}
        for directory in (self.root, self.path(PROGRESS_DIR)):
            if not os.path.isdir(directory):
                continue
            for name in os.listdir(directory):
                ours = bool(_TEMP_NAME.fullmatch(name)) if everything else name.startswith(tuple(wanted))
                if ours:
                    os.remove(os.path.join(directory, name))

    def verify(self, expected: Mapping[str, int] | None = None, id_column: str = "id") -> VerifyReport:
        """Re-read every committed part and check it against its record.

        `expected` (unit id -> records: output rows, or response lines) also checks that every planned unit
        is committed with that many and that the ledger holds nothing else; `id_column`: the records' id key.
        """
        report = VerifyReport()
        records, unreadable = self.records()
        report.errors += [why for _, why in sorted(unreadable.items())]
        for unit, rec in sorted(records.items()):
            path = self.path(rec.part)
            if not self.fs.exists(path):
                report.errors.append(f"unit {unit}: part {rec.part} is missing")
                continue
            size = self.fs.size(path)
            if size != rec.bytes:
                report.errors.append(f"unit {unit}: part {rec.part} has {size} bytes, ledger says {rec.bytes}")
                continue
            try:
                ids = [r[id_column] for r in self.part_rows(rec.part, [id_column])]
            except LedgerError as e:
                report.errors.append(f"unit {unit}: {e}")
                continue
            if len(ids) != rec.rows:
                report.errors.append(f"unit {unit}: part {rec.part} has {len(ids)} rows, ledger says {rec.rows}")
            if ids_checksum(ids) != rec.ids_sha256:
                report.errors.append(f"unit {unit}: ids in {rec.part} do not match the ledger checksum")
            report.committed_units += 1
            report.rows += len(ids)
        if expected is not None:
            missing = [u for u in expected if u not in records]
            if missing:
                report.errors.append(f"{len(missing)} unit(s) not committed yet, e.g. {missing[:5]}")
            wrong = [f"{u} ({records[u].rows} rows, planned {n})" for u, n in expected.items()
                     if u in records and records[u].rows != n]
            if wrong:
                report.errors.append(f"units with a wrong row count: {', '.join(wrong[:5])}")
            extra = sorted(set(records) - set(expected))
            if extra:
                report.errors.append(f"ledger has units outside the plan: {extra[:5]}")
        committed_parts = {r.part for r in records.values()}
        self.fs.invalidate_cache(self.root)
        try:
            names = [posixpath.basename(p) for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            names = []
        for name in sorted(names):
            if name.startswith(PART_PREFIX) and name not in committed_parts:
                report.notes.append(f"{name} has no ledger record (interrupted attempt; redone on resume)")
        return report
