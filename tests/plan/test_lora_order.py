"""Rows with LoRA adapters are planned by (adapter, token prefix): the base model's rows first, then each
adapter's rows together in token order; the prefill lower bound counts each adapter's prefix tree apart."""

from __future__ import annotations

from pipeline.plan.prefix import prefix_order
from pipeline.plan.window import PrefillLowerBound, WindowPlanner
from pipeline.source.prompts import Prepared


def test_prefix_order_groups_by_adapter_then_tokens():
    seqs = [[3, 1], [1, 2], [1, 1], [2], [1, 2], [0]]
    groups = ["b", None, "a", "b", "a", None]
    assert prefix_order(seqs, groups) == [5, 1, 2, 4, 3, 0]
    assert prefix_order(seqs) == [5, 2, 1, 4, 3, 0]  # no adapters: tokens alone, as before


def test_window_planner_puts_error_rows_first_and_groups_adapters():
    rows = [{"p": [2, 2], "a": "x"}, {"p": None, "a": None}, {"p": [1], "a": "x"}, {"p": [3], "a": None}]
    planner = WindowPlanner(lambda r: Prepared(r["p"], None, None if r["p"] else "bad", adapter=r["a"]))
    assert [i for i, _ in planner(rows)] == [1, 3, 2, 0]


def test_lower_bound_shares_no_prefix_across_adapters():
    bound = PrefillLowerBound()
    for adapter in (None, "a", "a", "b"):
        bound.add(0, [1, 2, 3, 4], adapter)
    assert bound.total == 12  # base, a (once) and b each compute the 4 tokens
    bound.add(1, [1, 2], "a")
    assert bound.total == 14
