"""SIGTERM/SIGINT as a stop request: recorded (not raised) while `stop_on_signals` is active, raised as Preempted
at a safe point, exit status 128 + the signal; a second signal a second later stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from visionrl.errors import Preempted
from visionrl.orchestrate import preemption


def _send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode boundary


def test_a_signal_is_a_stop_request_and_a_late_second_one_stops_at_once() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with preemption.stop_on_signals():
        assert preemption.requested() is None
        preemption.raise_if_requested()  # nothing requested: no-op
        _send(signal.SIGTERM)
        assert preemption.requested() == signal.SIGTERM  # recorded, the code running went on
        _send(signal.SIGINT)  # within a second: the same stop delivered twice, ignored
        with pytest.raises(Preempted) as stop:
            preemption.raise_if_requested()
        assert (stop.value.exit_status, stop.value.signal_name) == (143, "SIGTERM")  # 128 + 15
        time.sleep(preemption.REPEAT_S + 0.1)
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before and preemption.requested() is None


def test_sigint_exit_status_is_130() -> None:
    assert Preempted(signal.SIGINT).exit_status == 130  # 128 + 2, what shells report for Ctrl-C
