"""The fastest-call timers (`pipeline.stopwatch`) on a scripted clock: what they time and keep."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline import stopwatch
from pipeline.stopwatch import alternating_best, best_seconds


def test_best_seconds_times_calls_for_at_least_the_stretch_asked_and_keeps_the_fastest(monkeypatch):
    """A scripted clock: each call takes the next of `durations` seconds. After the untimed warm-up call, calls
    go on until both `reps` calls and `min_seconds` have passed, so a fast call late in the stretch counts."""
    now, durations, made = [0.0], [9.0, 0.4, 0.5, 0.3, 0.6, 0.1, 0.2], []

    def call() -> None:
        made.append(durations[len(made)])
        now[0] += made[-1]

    monkeypatch.setattr(stopwatch, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    assert best_seconds(call, reps=2, min_seconds=1.85) == pytest.approx(0.1)  # 0.4 + 0.5 + 0.3 + 0.6 < 1.85: a 5th call, 0.1
    assert made == durations[:6]
    made.clear()
    assert best_seconds(call, reps=2) == pytest.approx(0.4)  # no stretch: the warm-up and two calls
    assert made == durations[:3]


def test_alternating_best_reverses_the_order_every_round_and_gives_each_its_median(monkeypatch):
    """Each call of fn k takes the next of its own durations; every fn is warmed up once first, then the
    rounds run the fns in turn, the order reversed every other round."""
    now, order = [0.0], []
    durations = {"a": iter([9.0, 3.0, 1.0, 2.0]), "b": iter([9.0, 5.0, 6.0, 4.0])}

    def fn(name: str):
        def call() -> None:
            order.append(name)
            now[0] += next(durations[name])
        return call

    monkeypatch.setattr(stopwatch, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    assert alternating_best((fn("a"), fn("b")), rounds=3, reps=1) == [2.0, 5.0]  # medians of (3, 1, 2), (5, 6, 4)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
