"""Graceful stop: admission stops at the first signal, Interrupted comes before the grace period ends."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline.output.signals import GracefulStop, Interrupted


def spin_until_interrupted(limit_s: float) -> float:
    t0 = time.monotonic()
    with pytest.raises(Interrupted):
        while time.monotonic() - t0 < limit_s:
            time.sleep(0.005)
    return time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_first_signal_stops_admission_then_interrupts_within_grace(sig) -> None:
    with GracefulStop(grace_s=1.0, reserve_s=0.4) as stop:
        assert not stop.stopping
        os.kill(os.getpid(), sig)
        time.sleep(0.01)
        assert stop.stopping and signal.Signals(sig).name in stop.reason
        elapsed = spin_until_interrupted(5)
        assert 0.5 <= elapsed < 1.0  # at grace - reserve, leaving the reserve for cleanup


def test_second_signal_interrupts_at_once() -> None:
    with GracefulStop(grace_s=30) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.stopping
        t0 = time.monotonic()
        with pytest.raises(Interrupted, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert time.monotonic() - t0 < 0.5


def test_critical_section_defers_the_interruption() -> None:
    with GracefulStop(grace_s=0.3, reserve_s=0.1) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        finished = False
        with pytest.raises(Interrupted, match="during a commit"), stop.critical():
            time.sleep(0.5)  # the alarm fires in here
            finished = True
        assert finished


def test_handlers_are_restored_and_alarm_disarmed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with GracefulStop(grace_s=0.2):
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_stop_requested_from_another_thread_does_not_arm_the_alarm() -> None:
    with GracefulStop(grace_s=0.1) as stop:
        threading.Thread(target=stop.request_stop, args=("lease lost",)).start()
        time.sleep(0.3)  # no Interrupted: only a signal starts the grace clock
        assert stop.stopping and stop.reason == "lease lost"


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="runtime.grace_s"):
        GracefulStop(grace_s=0)
