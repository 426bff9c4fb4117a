"""Graceful stop: admission stops at the first signal, Interrupted comes before the grace period ends."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from pipeline.output.signals import GracefulStop, Interrupted


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_first_signal_stops_admission_then_interrupts_within_grace(sig, monkeypatch) -> None:
    """The first signal arms the alarm at grace - reserve (the reserve is for cleanup); the alarm interrupts.
    The alarm is delivered by the test, so nothing depends on how fast the machine is."""
    armed = []
    monkeypatch.setattr(signal, "setitimer", lambda which, seconds: armed.append((which, seconds)))
    with GracefulStop(grace_s=1.0, reserve_s=0.4) as stop:
        assert not stop.stopping
        os.kill(os.getpid(), sig)
        assert stop.stopping and signal.Signals(sig).name in stop.reason
        assert armed == [(signal.ITIMER_REAL, pytest.approx(0.6))]
        with pytest.raises(Interrupted, match="grace period of 1s spent"):
            os.kill(os.getpid(), signal.SIGALRM)


def test_second_signal_interrupts_at_once() -> None:
    with GracefulStop(grace_s=30) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.stopping
        with pytest.raises(Interrupted, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)


def test_critical_section_defers_the_interruption() -> None:
    with GracefulStop(grace_s=0.3, reserve_s=0.1) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        finished = False
        with pytest.raises(Interrupted, match="during a commit"), stop.critical():
            os.kill(os.getpid(), signal.SIGALRM)  # the grace period ends in here
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
        thread = threading.Thread(target=stop.request_stop, args=("lease lost",))
        thread.start()
        thread.join()
        assert stop.stopping and stop.reason == "lease lost"
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # only a signal starts the grace clock


def test_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="runtime.grace_s"):
        GracefulStop(grace_s=0)


def test_a_signal_notice_is_logged_off_the_signal_handler() -> None:
    """The handler may interrupt the main thread inside a log handler's write, where logging again raises
    (a reentrant call on the same stream): its notice is logged by another thread, before the block exits."""
    threads = []

    class Where(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            threads.append((record.getMessage(), threading.current_thread()))

    logger = logging.getLogger("pipeline.output.signals")
    where = Where()
    logger.addHandler(where)
    try:
        with GracefulStop(grace_s=30), pytest.raises(Interrupted):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the second interrupts at once
    finally:
        logger.removeHandler(where)
    assert [m for m, _ in threads] == ["stopping: received SIGTERM; finishing committed work within 30s"]
    assert threads[0][1] is not threading.main_thread()


def test_a_stop_requested_outside_the_block_is_logged_at_once(caplog) -> None:
    stop = GracefulStop(grace_s=1)
    with caplog.at_level(logging.WARNING, logger="pipeline.output.signals"):
        stop.request_stop("lease lost")
    assert "stopping: lease lost" in caplog.text
