"""Graceful stop on SIGTERM / SIGINT / SIGUSR1: finish what fits in the grace period, then exit 75.

Why: Slurm sends SIGUSR1 (with `--signal=USR1@<s>`) or SIGTERM before a time limit or preemption, and
kills with SIGKILL after its grace period. On the first signal the job stops admitting new rows, keeps
committing units whose rows all finish, and, when `runtime.grace_s` is nearly spent, `Interrupted` is
raised in the main thread (via SIGALRM) so the job can release its lease and exit in time. A second signal
interrupts at once. Commits run inside `critical()`, which defers the interruption until the unit is
committed, so an interrupt never costs finished work (a kill still cannot corrupt it: see ledger.py).

Exit codes (docs/checkpoints.md, "Exit codes"):
- 0  done: every unit of this shard is committed (or the output was already complete)
- 75 EX_TEMPFAIL, interrupted: committed work is kept; run the same command again to resume
- 73 EX_CANTCREAT, the output (or this shard) is leased by another live job
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

log = logging.getLogger(__name__)

EXIT_LOCKED = 73
EXIT_INTERRUPTED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Interrupted(Exception):
    """Raised in the main thread when the grace period is spent (or on a second signal)."""


class GracefulStop:
    """Installs the stop handlers for the duration of a `with` block (main thread only)."""

    def __init__(self, grace_s: float, reserve_s: float | None = None) -> None:
        if grace_s <= 0:
            raise ValueError(f"runtime.grace_s must be > 0, got {grace_s!r}")
        self.grace_s = grace_s
        # Time kept back after the interruption for releasing the lease and exiting.
        self.reserve_s = reserve_s if reserve_s is not None else min(5.0, grace_s / 5)
        self.reason: str | None = None
        self.signalled_at: float | None = None
        self._event = threading.Event()
        self._critical = 0
        self._pending = False
        self._previous: dict[int, object] = {}
        # The stop notice is logged by a thread of its own: a signal handler runs in the main thread between
        # any two bytecodes, also inside a log handler's write, and logging there again fails ("reentrant
        # call inside BufferedWriter"). SimpleQueue.put is safe to call from a signal handler.
        self._notices: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._notifier: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """True once a stop was requested: admit no more work."""
        return self._event.is_set()

    def request_stop(self, reason: str) -> None:
        """Stop admission from any thread (e.g. the lease heartbeat after losing the lease)."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()
            if self._notifier is None:  # outside the `with` block no handler is installed: log here
                log.warning("stopping: %s", reason)
            else:
                self._notices.put(reason)

    def _log_notices(self) -> None:
        while (reason := self._notices.get()) is not None:
            log.warning("stopping: %s", reason)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.stopping and self.signalled_at is not None:
            self._interrupt(f"second {name}")
            return
        self.signalled_at = time.monotonic()
        self.request_stop(f"received {name}; finishing committed work within {self.grace_s:g}s")
        signal.setitimer(signal.ITIMER_REAL, max(self.grace_s - self.reserve_s, 0.01))

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        self._interrupt(f"grace period of {self.grace_s:g}s spent")

    def _interrupt(self, why: str) -> None:
        if self._critical:
            self._pending = True
            return
        raise Interrupted(why)

    @contextmanager
    def critical(self) -> Iterator[None]:
        """Defer an interruption until the block ends (a unit commit is short and must not be cut)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
            if not self._critical and self._pending:
                self._pending = False
                raise Interrupted("grace period spent during a commit")

    def __enter__(self) -> GracefulStop:
        self._notifier = threading.Thread(target=self._log_notices, name="stop-notices", daemon=True)
        self._notifier.start()
        for s in STOP_SIGNALS:
            self._previous[s] = signal.signal(s, self._on_signal)
        self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._notifier is not None:  # every notice logged before the job reports its exit
            self._notices.put(None)
            self._notifier.join(timeout=5)
            self._notifier = None
