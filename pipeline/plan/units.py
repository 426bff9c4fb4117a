"""Work units with stable ids, and the split of units into shards.

Why: a restart must recompute exactly the same units so that committed ones are skipped and the rest are
redone whole. Everything here is derived from the input *listing* (paths, sizes, row counts from Parquet
metadata) and two plan numbers, never from row contents, so it is known before a single row is read.

Layout: the input rows, concatenated in listing order, are cut into *windows* of `window_rows` rows (the
prefix planner sorts rows inside one window, so rows sharing a prefix end up next to each other). Each
window's planned order is cut into *units* of `rows_per_part` rows; a unit never crosses a window. Shards
take contiguous, balanced ranges of units, so neighbours in the planned order (rows sharing a prefix) stay
in one shard except at the num_shards - 1 cut points.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InputFile:
    """One input shard as listed: the listing is part of the job fingerprint."""

    path: str
    size: int
    num_rows: int


@dataclass(frozen=True)
class Unit:
    """Positions [start, stop) of window `window`'s planned order; `id` names its part and ledger record."""

    index: int
    window: int
    start: int
    stop: int

    @property
    def id(self) -> str:
        return f"{self.index:06d}"

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WorkPlan:
    """Windows and units of one input listing. Cheap: O(number of files + number of units)."""

    files: tuple[InputFile, ...]
    window_rows: int
    rows_per_part: int

    def __post_init__(self) -> None:
        for key, value in (("window_rows", self.window_rows), ("rows_per_part", self.rows_per_part)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        for f in self.files:
            if f.num_rows < 0:
                raise ValueError(f"negative row count for input file {f.path}")

    @property
    def total_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    @property
    def num_windows(self) -> int:
        return math.ceil(self.total_rows / self.window_rows)

    def window_size(self, window: int) -> int:
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} out of range 0..{self.num_windows - 1}")
        return min(self.window_rows, self.total_rows - window * self.window_rows)

    def units_per_window(self, window: int) -> int:
        return math.ceil(self.window_size(window) / self.rows_per_part)

    @property
    def num_units(self) -> int:
        # All windows but the last are full, so this is arithmetic, not a loop over windows.
        if self.total_rows == 0:
            return 0
        full = self.num_windows - 1
        return full * math.ceil(self.window_rows / self.rows_per_part) + self.units_per_window(full)

    def units(self) -> Iterator[Unit]:
        for window in range(self.num_windows):
            yield from self.window_units(window)

    def window_units(self, window: int) -> list[Unit]:
        """The units of one window (every window before it is full, so their indexes are arithmetic)."""
        size, per = self.window_size(window), self.rows_per_part
        first = window * math.ceil(self.window_rows / per)
        return [Unit(first + k, window, start, min(start + per, size)) for k, start in enumerate(range(0, size, per))]

    def shard_units(self, num_shards: int, shard_index: int) -> list[Unit]:
        """Contiguous, balanced range of units for one shard; the union over all shards is every unit once."""
        check_shard(num_shards, shard_index)
        lo, hi = shard_bounds(self.num_units, num_shards, shard_index)
        return [u for u in self.units() if lo <= u.index < hi]

    def fingerprint(self) -> dict:
        """What the unit ids depend on (goes into the job manifest)."""
        return {
            "window_rows": self.window_rows,
            "rows_per_part": self.rows_per_part,
            "files": [[f.path, f.size, f.num_rows] for f in self.files],
        }


def shard_bounds(num_items: int, num_shards: int, shard_index: int) -> tuple[int, int]:
    """[lo, hi) of a balanced contiguous split: sizes differ by at most one."""
    return num_items * shard_index // num_shards, num_items * (shard_index + 1) // num_shards


def check_shard(num_shards: int, shard_index: int) -> None:
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise ValueError(f"runtime.num_shards must be an integer >= 1, got {num_shards!r}")
    if not isinstance(shard_index, int) or isinstance(shard_index, bool) or not 0 <= shard_index < num_shards:
        raise ValueError(f"runtime.shard_index must be in 0..{num_shards - 1}, got {shard_index!r}")


def resolve_shard(
    num_shards: int | None, shard_index: int | None, env: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """Explicit config wins; otherwise a Slurm array task gives its own index; otherwise one shard.

    `SLURM_ARRAY_TASK_COUNT` / `SLURM_ARRAY_TASK_ID` assume the array is 0-based and contiguous
    (`--array=0-N`); an array with an offset (`--array=1-4`) is rejected rather than silently mis-split.
    """
    if num_shards is None and "SLURM_ARRAY_TASK_COUNT" in env:
        num_shards = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    if shard_index is None and "SLURM_ARRAY_TASK_ID" in env:
        if env.get("SLURM_ARRAY_TASK_MIN", "0") != "0":
            raise ValueError(
                f"Slurm array starts at SLURM_ARRAY_TASK_MIN={env['SLURM_ARRAY_TASK_MIN']}: submit it as "
                "--array=0-<N-1> or set runtime.shard_index explicitly"
            )
        shard_index = _env_int(env, "SLURM_ARRAY_TASK_ID")
    num_shards = 1 if num_shards is None else num_shards
    shard_index = 0 if shard_index is None else shard_index
    check_shard(num_shards, shard_index)
    return num_shards, shard_index


def _env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"environment variable {key}={env[key]!r} is not an integer") from None


def group_units_by_window(units: Sequence[Unit]) -> dict[int, list[Unit]]:
    """Units of each window in order, so a window is read and planned once for all its units."""
    out: dict[int, list[Unit]] = {}
    for u in units:
        out.setdefault(u.window, []).append(u)
    return out
