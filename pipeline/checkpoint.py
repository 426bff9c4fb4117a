"""Checkpointed run state for `job.py`: which units this run owns, which rows to read, when to commit.

Why one module: the job should read as "rows in -> engine -> rows out"; the bookkeeping that makes a run
resumable (shard, lease, manifest, ledger, unit completion) lives here, behind three calls:
`Checkpoint.start()` before the model loads, `Checkpoint.rows()` to stream the rows still to do, and
`UnitWriter.add()` for every output row (a unit is committed the moment its last row arrives).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

from pipeline.errors import JobError
from pipeline.io.lease import Lease, LeaseHeld
from pipeline.io.ledger import Ledger
from pipeline.io.manifest import check_not_a_file, make_manifest, prepare_output
from pipeline.io.sink import ParquetSink
from pipeline.io.source import ParquetSource, Shard
from pipeline.signals import GracefulStop
from pipeline.units import InputFile, Unit, WorkPlan, group_units_by_window, resolve_shard

log = logging.getLogger(__name__)


# Engine settings that change speed or memory but not what a (float32, greedy or seeded) row produces; any
# other engine key (including ones added later) is part of the fingerprint, to err on the side of refusing.
_SPEED_ONLY_ENGINE_KEYS = ("block_size", "kv_cache_memory", "max_batched_tokens", "max_batch_size",
                           "prefix_caching", "device", "tensor_parallel", "max_waiting")


def job_fingerprint(resolved: Mapping[str, Any], model_path: str) -> dict[str, Any]:
    """What determines the output rows: model identity, sampling, prompt/template settings, output schema.

    The input *listing* and plan numbers are added by `Checkpoint.start`; the input glob itself is not
    part of it (the same files under another spelling are the same job).
    """
    inp = {k: v for k, v in resolved["input"].items() if k not in ("path", "batch_rows")}
    engine = {k: v for k, v in resolved["engine"].items() if k not in _SPEED_ONLY_ENGINE_KEYS}
    return {
        "model": {**resolved["model"], **model_identity(model_path)},
        "sampling": resolved["sampling"],
        "input": inp,
        "engine": engine,
        "output": {"token_ids": resolved["output"]["token_ids"]},
        # which rows share a unit (plan.window_rows is in the plan numbers)
        "order": {"prefix_sort": resolved.get("plan", {}).get("prefix_sort")},
    }


def model_identity(path: str) -> dict[str, Any]:
    """Path and byte sizes of a model file or directory: cheap, and changes when the weights are replaced."""
    if os.path.isdir(path):
        sizes = {n: os.path.getsize(os.path.join(path, n)) for n in sorted(os.listdir(path))
                 if os.path.isfile(os.path.join(path, n))}
        return {"path": path, "files": sizes}
    return {"path": path, "bytes": os.path.getsize(path) if os.path.exists(path) else None}


class Checkpoint:
    """Plan, shard, lease and ledger of one run over one output."""

    def __init__(self, output_path: str, source: ParquetSource, *, rows_per_part: int, window_rows: int,
                 num_shards: int | None, shard_index: int | None, lease_timeout_s: float,
                 stop: GracefulStop) -> None:
        try:
            self.num_shards, self.shard_index = resolve_shard(num_shards, shard_index)
        except ValueError as e:
            raise JobError(f"invalid config: {e}") from None
        self.source = source
        files = tuple(InputFile(s.name, s.size, s.num_rows) for s in source.shards)
        self.plan = WorkPlan(files, window_rows=window_rows, rows_per_part=rows_per_part)
        self.fs, self.root = url_to_fs(output_path)
        self.ledger = Ledger(self.fs, self.root)
        self.stop = stop
        self.lease = Lease(self.fs, self.root, self.num_shards, self.shard_index, timeout_s=lease_timeout_s,
                           on_lost=stop.request_stop)
        self.mine: list[Unit] = []
        self.todo: list[Unit] = []

    @property
    def shard_label(self) -> str:
        return "" if self.num_shards == 1 else f"shard {self.shard_index}/{self.num_shards} "

    def start(self, fingerprint: Mapping[str, Any], mode: str) -> str:
        """Take the lease, check the output against the manifest, find the units still to do.

        Returns 'complete' (nothing to do: the whole output is done), 'idle' (this shard is done) or 'run'.
        """
        check_not_a_file(self.fs, self.root)  # before the lease, which lives inside the output
        self.lease.acquire()
        try:
            manifest = make_manifest({**fingerprint, "plan": self.plan.fingerprint()})
            state = prepare_output(self.fs, self.root, manifest, mode, self.num_shards)
            if state == "complete":
                return "complete"
            self.mine = self.plan.shard_units(self.num_shards, self.shard_index)
            done = self.ledger.committed()
            self.todo = [u for u in self.mine if u.id not in done]
            self.ledger.remove_leftovers(u.id for u in self.todo)
        except BaseException:
            self.lease.release()
            raise
        log.info("%s%d units (%d rows), %d already committed, %d to do (%d rows)", self.shard_label,
                 len(self.mine), sum(u.num_rows for u in self.mine), len(self.mine) - len(self.todo),
                 len(self.todo), self.todo_rows)
        return "run" if self.todo else "idle"

    @property
    def todo_rows(self) -> int:
        return sum(u.num_rows for u in self.todo)

    def rows(self, columns: list[str], batch_rows: int,
             planner: Callable[[list[dict]], list[tuple[int, Any]]] | None = None,
             ) -> Iterator[tuple[Unit, int, Shard, int, Any]]:
        """(unit, position in unit, input file, row index in file, row) for every row still to do, in
        unit order. Windows with nothing to do are skipped without decoding; one window is held at a time.
        Stops early once a stop was requested (the unfinished unit is redone on resume).

        `planner` (see pipeline/plan/window.py) gets each whole window's rows and returns its planned order
        as (index in the window, item); units are cut from that order and the item is yielded as the row.
        It must be deterministic so that a restart cuts the same units. Without it the order is the input's."""
        by_window = group_units_by_window(self.todo)
        if not by_window:
            return
        last = max(by_window)
        wr = self.plan.window_rows
        window: list[tuple[Shard, int, dict]] = []
        offset = 0  # global index of the batch's first row
        for shard, start, batch in self.source.batches(columns, batch_rows):
            lo, hi = offset, offset + batch.num_rows
            offset = hi
            if not any(w in by_window for w in range(lo // wr, (hi - 1) // wr + 1)):
                continue
            for i, row in enumerate(batch.to_pylist()):
                g = lo + i
                if g // wr not in by_window:
                    continue
                window.append((shard, start + i, row))
                w = g // wr
                if len(window) == self.plan.window_size(w):
                    if planner is not None:
                        window = [(*window[i][:2], item) for i, item in planner([r for _, _, r in window])]
                    for unit in by_window[w]:
                        for pos in range(unit.start, unit.stop):
                            if self.stop.stopping:
                                return
                            yield (unit, pos - unit.start, *window[pos])
                    window = []
                    if w == last:
                        return
        raise JobError(f"the input changed while it was read: {self.plan.total_rows} rows listed, {offset} read")

    def finish(self) -> bool:
        """After this shard's units are all committed: write `_SUCCESS` if every shard's are."""
        return self.ledger.mark_success([u.id for u in self.plan.units()])

    def close(self) -> None:
        self.lease.release()


@dataclass
class _Open:
    unit: Unit
    expected: int
    rows: list[tuple[int, int, dict]] = field(default_factory=list)  # (position, sample_index, row)


class UnitWriter:
    """Collects each unit's output rows and commits the unit when its last row arrives.

    Rows are sorted by (input position, sample index) before writing, so a part's content does not depend
    on the order in which the engine finished its rows.
    """

    def __init__(self, checkpoint: Checkpoint, sink: ParquetSink, samples: int) -> None:
        self.checkpoint = checkpoint
        self.sink = sink
        self.samples = samples
        self.open: dict[int, _Open] = {}
        self.committed_units = 0
        self.rows_written = 0

    def add(self, unit: Unit, position: int, row: dict) -> None:
        slot = self.open.get(unit.index)
        if slot is None:
            slot = self.open[unit.index] = _Open(unit, unit.num_rows * self.samples)
        slot.rows.append((position, row.get("sample_index", 0), row))
        if len(slot.rows) == slot.expected:
            del self.open[unit.index]
            self._commit(slot)

    def _commit(self, slot: _Open) -> None:
        lease = self.checkpoint.lease
        if lease.lost:
            raise LeaseHeld(f"not committing unit {slot.unit.id}: {lease.lost}")
        slot.rows.sort(key=lambda r: (r[0], r[1]))
        rows = [r for _, _, r in slot.rows]
        with self.checkpoint.stop.critical():
            part = self.sink.write_rows(slot.unit.id, rows)
            self.checkpoint.ledger.commit(slot.unit.id, part.name, part.bytes, [r["id"] for r in rows])
        self.committed_units += 1
        self.rows_written += part.rows
