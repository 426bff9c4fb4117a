"""Fastest-call timers for measurements taken on a shared machine: the probe's peaks and the choices a
load or a batch tuner makes by timing (a slow spell of a virtual machine slows some calls, never speeds
one up, so the fastest of several is the steadiest figure)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def best_seconds(fn: Callable[[], object], reps: int, min_seconds: float = 0.0, warmup: bool = True) -> float:
    """The fastest wall time of at least `reps` calls, and of as many more as `min_seconds` takes, after one
    warm-up call (`warmup=False`: the caller warmed fn up): the least-disturbed run on a shared machine."""
    if warmup:
        fn()  # page faults, kernel selection
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


def alternating_best(fns: Sequence[Callable[[], object]], rounds: int, reps: int) -> list[float]:
    """Each fn's median over `rounds` rounds of its best of `reps` calls (`best_seconds`), the fns taking
    turns in an order reversed every round, after one warm-up call each: a drift of the machine's speed
    over the rounds weighs on all of them alike."""
    for fn in fns:
        fn()
    best: list[list[float]] = [[] for _ in fns]
    order = list(range(len(fns)))
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            best[k].append(best_seconds(fns[k], reps, warmup=False))
    return [statistics.median(b) for b in best]
