"""Work units and shards: every input row in exactly one unit, every unit in exactly one shard."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.plan.units import InputFile, WorkPlan, resolve_shard, shard_bounds


def make_plan(rows: list[int], window_rows: int, rows_per_part: int) -> WorkPlan:
    files = tuple(InputFile(f"in/f{i}.parquet", 100 + n, n) for i, n in enumerate(rows))
    return WorkPlan(files, window_rows=window_rows, rows_per_part=rows_per_part)


plans = st.builds(
    make_plan,
    st.lists(st.integers(0, 60), max_size=6),
    st.integers(1, 25),
    st.integers(1, 12),
)


@settings(max_examples=150, deadline=None)
@given(plans)
def test_windows_and_units_cover_every_row_once(plan: WorkPlan) -> None:
    sizes = [plan.window_size(w) for w in range(plan.num_windows)]
    assert sum(sizes) == plan.total_rows == sum(f.num_rows for f in plan.files)  # windows tile the input
    assert all(s == plan.window_rows for s in sizes[:-1]) and all(1 <= s <= plan.window_rows for s in sizes)
    units = list(plan.units())
    assert len(units) == plan.num_units
    assert [u.index for u in units] == list(range(len(units)))
    for w in range(plan.num_windows):
        mine = [u for u in units if u.window == w]
        covered = [p for u in mine for p in range(u.start, u.stop)]
        assert covered == list(range(plan.window_size(w)))  # units tile each window, never cross it
        assert all(1 <= u.num_rows <= plan.rows_per_part for u in mine)


@settings(max_examples=150, deadline=None)
@given(plans, st.integers(1, 9))
def test_shards_partition_units_contiguously_and_balanced(plan: WorkPlan, num_shards: int) -> None:
    shards = [plan.shard_units(num_shards, i) for i in range(num_shards)]
    flat = [u.index for s in shards for u in s]
    assert flat == list(range(plan.num_units))  # union is every unit, once, in order
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_unit_ids_are_stable_and_depend_only_on_the_listing() -> None:
    a = make_plan([30, 7, 50], window_rows=16, rows_per_part=5)
    b = make_plan([30, 7, 50], window_rows=16, rows_per_part=5)
    assert list(a.units()) == list(b.units())
    assert a.fingerprint() == b.fingerprint()
    assert [u.id for u in a.units()][:3] == ["000000", "000001", "000002"]
    grown = WorkPlan(a.files[:2] + (InputFile("in/f2.parquet", 151, 51),), 16, 5)
    assert grown.fingerprint() != a.fingerprint()
    assert make_plan([30, 7, 50], window_rows=16, rows_per_part=4).fingerprint() != a.fingerprint()


def test_window_crossing_files_and_unit_count_arithmetic() -> None:
    plan = make_plan([3, 4], window_rows=5, rows_per_part=2)
    assert [plan.window_size(w) for w in range(plan.num_windows)] == [5, 2]  # window 0 crosses the files
    # window 0: 5 rows -> units of 2,2,1; window 1: 2 rows -> one unit
    assert [(u.window, u.start, u.stop) for u in plan.units()] == [(0, 0, 2), (0, 2, 4), (0, 4, 5), (1, 0, 2)]


def test_empty_input_and_more_shards_than_units() -> None:
    empty = make_plan([0, 0], window_rows=4, rows_per_part=2)
    assert empty.num_windows == 0 and empty.num_units == 0 and list(empty.units()) == []
    small = make_plan([3], window_rows=4, rows_per_part=2)
    assert [len(small.shard_units(5, i)) for i in range(5)] == [0, 0, 1, 0, 1]


@pytest.mark.parametrize("key,value", [("window_rows", 0), ("rows_per_part", -1), ("rows_per_part", 2.5)])
def test_plan_numbers_are_validated(key: str, value) -> None:
    kwargs = {"window_rows": 4, "rows_per_part": 2, key: value}
    with pytest.raises(ValueError, match=key):
        WorkPlan((), **kwargs)


def test_shard_bounds_are_balanced() -> None:
    assert [shard_bounds(10, 4, i) for i in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]


def test_resolve_shard_from_config_and_slurm() -> None:
    assert resolve_shard(None, None, env={}) == (1, 0)
    assert resolve_shard(4, 2, env={}) == (4, 2)
    slurm = {"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "0"}
    assert resolve_shard(None, None, env=slurm) == (8, 3)
    assert resolve_shard(2, 1, env=slurm) == (2, 1)  # explicit config wins


@pytest.mark.parametrize(
    "num,index,env,match",
    [
        (4, 4, {}, "shard_index must be in 0..3"),
        (0, 0, {}, "num_shards must be an integer >= 1"),
        (None, None, {"SLURM_ARRAY_TASK_COUNT": "x", "SLURM_ARRAY_TASK_ID": "0"}, "SLURM_ARRAY_TASK_COUNT"),
        (None, None, {"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1"},
         "SLURM_ARRAY_TASK_MIN=1"),
        (None, None, {"SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_ID": "6"}, "shard_index must be in 0..3"),
    ],
)
def test_resolve_shard_errors_name_the_key(num, index, env, match) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_shard(num, index, env=env)
