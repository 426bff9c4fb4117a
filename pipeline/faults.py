"""Fault injection for the crash tests: the one place that reads `PIPELINE_FAULT`.

`PIPELINE_FAULT=<point>:<n>` makes the n-th arrival at `fault_point("<point>")` kill this process with
SIGKILL (no cleanup, no flush: what a power cut or the OOM killer does). `<point>:<n>:hang` blocks there
instead, for good (signals still run their handlers), after printing `fault <spec>: hanging` on stderr:
work that never finishes, so a test of a stop signal does not depend on how fast the machine is. `<point>:<n>:sleep=<s>` pauses there for s seconds (to
widen a race window). `<point>:<n>:wait=<path>` prints `fault <spec>: waiting` on stderr and pauses until the
file `<path>` (a path without `:`) exists: a test can act on the process while it is known to stand at that point (stop it with
SIGSTOP, let another job run), then let it go on. Unset, a point costs one dict lookup. The environment is read at each call so a
process forked from a preloaded parent still obeys it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV = "PIPELINE_FAULT"
_arrivals: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, count, *action = spec.split(":")
    if point != name:
        return
    _arrivals[name] = _arrivals.get(name, 0) + 1
    if _arrivals[name] != int(count):
        return
    what = action[0] if action else "kill"
    if what == "hang":
        print(f"fault {spec}: hanging", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    elif what.startswith("sleep="):
        time.sleep(float(what.removeprefix("sleep=")))
    elif what.startswith("wait="):
        print(f"fault {spec}: waiting", file=sys.stderr, flush=True)
        while not os.path.exists(what.removeprefix("wait=")):
            time.sleep(0.05)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
