"""The window planner: a window's rows -> planned order with each row's prepared prompt (no model needed)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline.plan.prefix import unique_prefix_tokens
from pipeline.plan.window import PrefillLowerBound, WindowPlanner
from pipeline.source.prompts import Prepared

# A row is {"tokens": [...]} or {"tokens": None} (an error row).
rows_st = st.lists(st.fixed_dictionaries({"tokens": st.none() | st.lists(st.integers(0, 3), min_size=1, max_size=6)}),
                   max_size=25)


class CountingPrepare:
    """A stand-in for PromptBuilder.prepare that counts its calls per row."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, row: dict) -> Prepared:
        self.calls.append(id(row))
        tokens = row["tokens"]
        return Prepared(None, None, "bad row") if tokens is None else Prepared(list(tokens), None)


@given(rows_st)
def test_sorted_plan_is_a_stable_token_order_with_errors_first(rows):
    prepare = CountingPrepare()
    planned = WindowPlanner(prepare, prefix_sort=True)(rows)
    order = [i for i, _ in planned]
    assert sorted(order) == list(range(len(rows)))
    assert sorted(prepare.calls) == sorted(id(r) for r in rows)  # each row prepared exactly once
    keys = [rows[i]["tokens"] or [] for i in order]
    for (a, ka), (b, kb) in zip(zip(order, keys), zip(order[1:], keys[1:])):
        assert ka < kb or (ka == kb and a < b)
    for i, item in planned:  # each row carries its own prepared prompt
        assert item.row is rows[i] and item.prepared.token_ids == rows[i]["tokens"]
    errors = [rows[i]["tokens"] is None for i in order]
    assert errors == sorted(errors, reverse=True)  # error rows (no tokens) first, deterministically
    assert order == [i for i, _ in WindowPlanner(CountingPrepare(), prefix_sort=True)(rows)]


@given(rows_st)
def test_unsorted_plan_keeps_input_order(rows):
    planner = WindowPlanner(CountingPrepare(), prefix_sort=False)
    assert [i for i, _ in planner(rows)] == list(range(len(rows)))
    assert planner.windows == 1


@given(st.lists(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=8), max_size=5))
def test_lower_bound_sums_each_windows_prefix_tree(windows):
    bound = PrefillLowerBound()
    for w, seqs in enumerate(windows):
        for s in seqs:
            bound.add(w, s)
    assert bound.total == sum(unique_prefix_tokens(seqs) for seqs in windows)


def test_lower_bound_counts_a_shared_prefix_once_per_window():
    bound = PrefillLowerBound()
    bound.add(0, [1, 2, 3, 4])
    bound.add(0, [1, 2, 3, 5])
    assert bound.total == 5
    bound.add(1, [1, 2, 3, 4])  # a new window: its tree starts empty
    assert bound.total == 9
