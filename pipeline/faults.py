"""Fault injection for the crash tests: the one place that reads `PIPELINE_FAULT`.

`PIPELINE_FAULT=<point>:<n>` makes the n-th arrival at `fault_point("<point>")` kill this process with
SIGKILL (no cleanup, no flush: what a power cut or the OOM killer does). Unset, a point costs one dict
lookup. The environment is read at each call so a process forked from a preloaded parent still obeys it.
"""

from __future__ import annotations

import os
import signal

ENV = "PIPELINE_FAULT"
_arrivals: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, count = spec.rpartition(":")
    if point != name:
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    if _arrivals[name] == int(count):
        os.kill(os.getpid(), signal.SIGKILL)
