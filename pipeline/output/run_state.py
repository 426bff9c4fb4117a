"""The resumable state of one run over one output: which units this run owns, which are still to do.

Why one module: the job should read as "rows in -> engine -> rows out"; the bookkeeping that makes a run
resumable (shard, lease, manifest, ledger, unit completion) lives here, behind two calls:
`RunState.start()` before the model loads, and `UnitWriter.add()` for every output row (a unit is
committed the moment its last row arrives). Which rows to read is `pipeline.plan.rows.rows_to_do`.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow as pa
from fsspec.core import url_to_fs

from pipeline.errors import JobError
from pipeline.output.lease import Lease
from pipeline.output.ledger import CommitRecord, Ledger, LedgerError
from pipeline.output.manifest import JOB_FILE, check_not_a_file, make_manifest, prepare_output
from pipeline.output.signals import GracefulStop
from pipeline.plan.digests import changed_units, describe_changed
from pipeline.plan.units import Unit, WorkPlan, resolve_shard

log = logging.getLogger(__name__)


class RunState:
    """Plan, shard, lease and ledger of one run over one output."""

    def __init__(self, output_path: str, plan: WorkPlan, fingerprint: Mapping[str, Any], *,
                 num_shards: int | None, shard_index: int | None, lease_timeout_s: float,
                 stop: GracefulStop, read_input: Callable[[], Iterable[tuple[str, pa.RecordBatch]]],
                 on_input_change: str = "fail", inputs: Mapping[str, str] | None = None,
                 retry_errors: bool = False) -> None:
        """`fingerprint`: what determines the output rows (`JobConfig.fingerprint` and the input content);
        with the plan's own numbers it makes the manifest a resume must match. `read_input`: (file name,
        batch) of the whole input in listing order, the columns the job reads, for checking committed
        units against their input rows; `on_input_change`: `fail` or `redo` when they changed.
        `inputs`: input file URLs; `retry_errors`: redo the error rows of committed units too."""
        try:
            self.num_shards, self.shard_index = resolve_shard(num_shards, shard_index)
        except ValueError as e:
            raise JobError(f"invalid config: {e}") from None
        self.plan = plan
        self.manifest = make_manifest({**fingerprint, "plan": plan.fingerprint()}, inputs)
        self.fs, self.root = url_to_fs(output_path)
        self.ledger = Ledger(self.fs, self.root)
        self.stop = stop
        self.read_input = read_input
        self.on_input_change = on_input_change
        self.retry_errors = retry_errors
        self.lease = Lease(self.fs, self.root, self.num_shards, self.shard_index, timeout_s=lease_timeout_s,
                           on_lost=stop.request_stop)
        self.mine: list[Unit] = []
        self.todo: list[Unit] = []
        self.fixed: dict[int, list[int]] = {}  # unit index -> input rows, of committed units (`UnitRows`)
        self.retry: dict[int, list[int]] = {}  # unit index -> positions of its error rows to redo
        self.fresh = False  # this run wrote the manifest

    @property
    def shard_label(self) -> str:
        return "" if self.num_shards == 1 else f"shard {self.shard_index}/{self.num_shards} "

    def start(self, mode: str) -> str:
        """Take the lease, check the output against the manifest, find the units still to do.

        Returns 'complete' (nothing to do: the whole output is done), 'idle' (this shard is done) or 'run'.
        """
        try:
            check_not_a_file(self.fs, self.root)  # before the lease, which lives inside the output
            self.lease.acquire()
        except OSError as e:  # e.g. a read-only or full disk: name the output and the cause
            raise JobError(f"cannot use output.path {self.root}: {e}") from None
        try:
            state = prepare_output(self.fs, self.root, self.manifest, mode, self.num_shards)
            self.fresh = state == "fresh"
            done = self._intact_commits()
            if state == "complete" and len(done) == self.plan.num_units and not self.retry_errors:
                return "complete"
            self.mine = self.plan.shard_units(self.num_shards, self.shard_index)
            changed = self._changed_input({u: done[u.id] for u in self.mine if u.id in done})
            self.todo = [u for u in self.mine if u.id not in done or u.id in changed]
            intact = {unit: rec for unit, rec in done.items() if unit not in changed}
            if self.retry_errors:
                self._find_errors({u: intact[u.id] for u in self.mine if u.id in intact})
            self._fix_rows(intact)
            # With the whole output leased, every temp file of an interrupted write is ours to delete.
            self.ledger.remove_leftovers((u.id for u in self.todo), everything=self.num_shards == 1)
        except (OSError, LedgerError) as e:  # LedgerError: a part that cannot be read
            self.lease.release()
            raise JobError(f"cannot use output.path {self.root}: {e}") from None
        except BaseException:
            self.lease.release()
            raise
        log.info("%s%d units (%d rows), %d already committed, %d to do (%d rows)", self.shard_label,
                 len(self.mine), sum(u.num_rows for u in self.mine), len(self.mine) - len(self.todo),
                 len(self.todo), self.todo_rows)
        return "run" if self.todo else "idle"

    def _intact_commits(self) -> dict[str, CommitRecord]:
        """Committed units whose part is there with its recorded size; a damaged one is uncommitted (and
        `_SUCCESS` withdrawn), so it is redone rather than trusted."""
        records, unreadable = self.ledger.records()
        bad = {**unreadable, **self.ledger.damaged(records)}
        self._uncommit(bad)
        return {unit: rec for unit, rec in records.items() if unit not in bad}

    def _changed_input(self, committed: Mapping[Unit, CommitRecord]) -> set[str]:
        """Committed units of this shard whose input rows changed since they were committed (records without
        row digests, from before them, are not checked). With `on_input_change=fail` a JobError names them
        and their files; with `redo` they are uncommitted, to be redone."""
        recorded = {u: rec.input_sha256 for u, rec in committed.items() if rec.input_sha256 is not None}
        if recorded:
            log.info("%schecking the input rows of %d committed units", self.shard_label, len(recorded))
        changed = changed_units(self.read_input(), self.plan, recorded)
        if changed and self.on_input_change == "fail":
            raise JobError(f"input rows changed since they were committed: {describe_changed(changed)}; "
                           "restore the input, or set output.on_input_change=redo to redo those units")
        self._uncommit({unit: f"its input rows in {', '.join(files)} changed since it was committed"
                        for unit, files in changed.items()})
        return set(changed)

    def _find_errors(self, committed: Mapping[Unit, CommitRecord]) -> None:
        """`output.retry_errors`: this shard's committed units whose parts hold error rows (`error` not null)
        are to do again, those input rows only: `retry` gets their positions, `fixed` the part's input rows.
        A part written before parts recorded their input rows cannot say which input rows failed: it stays."""
        found = 0
        for unit, rec in committed.items():
            errors = [r["error"] for r in self.ledger.part_rows(rec.part, ["error"])]
            input_rows = self.ledger.part_input_rows(rec)
            samples = len(errors) // unit.num_rows
            failed = sorted({j // samples for j, e in enumerate(errors) if e is not None})
            found += len(failed)
            if failed and input_rows is None:
                log.warning("unit %s: its %d error rows are not retried: part %s was written before parts "
                            "recorded their input rows", unit.id, len(failed), rec.part)
            elif failed:
                self.retry[unit.index], self.fixed[unit.index] = failed, input_rows
        log.info("%soutput.retry_errors: %d error rows found in %d committed units; %d are retried",
                 self.shard_label, found, len(committed), self.retry_rows)
        if self.retry:
            self.todo = sorted([*self.todo, *(u for u in committed if u.index in self.retry)], key=lambda u: u.index)
            self.ledger.withdraw_success()  # back when every unit is committed again

    def _fix_rows(self, committed: Mapping[str, CommitRecord]) -> None:
        """The input rows of the committed units (of any shard) sharing a window with a unit to cut from the
        planned order, from their parts' footers (`UnitRows`). A part written before parts recorded them
        gives none: its unit is cut from the planned order, as it was then."""
        for window in {u.window for u in self.todo if u.index not in self.retry}:
            for unit in self.plan.window_units(window):
                if unit.id in committed and unit.index not in self.fixed:
                    rows = self.ledger.part_input_rows(committed[unit.id])
                    if rows is not None:
                        self.fixed[unit.index] = rows

    def _uncommit(self, bad: Mapping[str, str]) -> None:
        """Drop these units' records (unit -> why, logged) and `_SUCCESS`: they are to do again."""
        for unit, why in sorted(bad.items()):
            log.warning("unit %s is redone: %s", unit, why)
            self.ledger.uncommit(unit)
        if bad:
            self.ledger.withdraw_success()

    @property
    def todo_rows(self) -> int:
        return sum(u.num_rows for u in self.todo if u.index not in self.retry) + self.retry_rows

    @property
    def retry_rows(self) -> int:
        """Input rows of committed units this run runs again (`output.retry_errors`)."""
        return sum(len(positions) for positions in self.retry.values())

    def finish(self) -> bool:
        """After this shard's units are all committed: write `_SUCCESS` if every shard's are."""
        return self.ledger.mark_success([u.id for u in self.plan.units()])

    def close(self) -> None:
        """Release the lease. A run that wrote the manifest but committed nothing (a failed model load, a
        bad engine setting, a stop before the first commit) takes the manifest back, so the corrected
        rerun starts fresh instead of being refused as another configuration; unless it lost the lease:
        the manifest is then the new holder's."""
        try:
            if (self.lease.lost is None and self.fresh and self.num_shards == 1 and not self.ledger.committed()
                    and not self.ledger.is_complete()):
                self.fs.rm(posixpath.join(self.root, JOB_FILE))
        finally:
            self.lease.release()
