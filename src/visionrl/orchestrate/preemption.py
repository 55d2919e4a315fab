"""Graceful stop on SIGTERM / SIGINT: what Slurm, SageMaker HyperPod and Kubernetes send before they kill a job.

While `stop_on_signals()` is active, the first signal only records a stop request; the loop sees it at the
next safe point (an interruptible wait, or the end of a step), checkpoints the last completed step and ends
with `Preempted`, which the CLI turns into exit status 128 + the signal number (143 for SIGTERM, 130 for
SIGINT). A second signal more than a second later interrupts at once (KeyboardInterrupt), for a user who does
not want to wait.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

from visionrl.errors import Preempted

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_S = 1.0
_requested: list[int] = []  # the signal numbers received while active (the first one decides)
_first_at: list[float] = [0.0]


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _requested:
        # A second signal: stop now, without the checkpoint. One that follows within a second is the same
        # stop delivered twice (a wrapper such as `timeout` or a launcher passing on what it got), not a user's.
        if time.monotonic() - _first_at[0] > REPEAT_S:
            raise KeyboardInterrupt
        return
    _requested.append(signum)
    _first_at[:] = [time.monotonic()]
    logger.warning(
        "%s received: stopping at the next safe point after checkpointing the last completed step "
        "(send it again to stop at once)",
        signal.Signals(signum).name,
    )


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Record SIGTERM/SIGINT as a stop request inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _requested.clear()
    previous = {s: signal.signal(s, _on_signal) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _requested.clear()


def requested() -> int | None:
    """The signal number of a pending stop request, or None."""
    return _requested[0] if _requested else None


def raise_if_requested() -> None:
    if _requested:
        raise Preempted(_requested[0])
