"""The Ray a run uses: a cluster it attaches to (`ray.address` / RAY_ADDRESS, waited for up to
`ray.startup_timeout_s`), or a local Ray it starts in a temp dir and tears down at its end, every Ray process gone.
Ray's own output goes to the run's libraries.log unless verbose (`console`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import ray

from visionrl.config import RayConfig
from visionrl.errors import InputError
from visionrl.orchestrate import console
from visionrl.rollout.scratch import process_alive

logger = logging.getLogger(__name__)


def wait_for_ray(address: str, timeout_s: float, poll_s: float = 2.0) -> None:
    """Until something listens at a `host:port` Ray address, for at most `timeout_s`: `ray.init` alone retries a
    wrong address forever with only its own warnings. Other forms (`auto`, `ray://...`) are left to Ray."""
    import socket

    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    deadline, told = time.monotonic() + timeout_s, 0.0
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as err:
            waited = timeout_s - (deadline - time.monotonic())
            if time.monotonic() >= deadline:
                raise InputError(
                    f"no Ray answers at ray.address={address} after {waited:.0f} s ({err}); check the head node's "
                    "address and port (`ray status` on the head prints it), that the head is running, or leave "
                    "ray.address and RAY_ADDRESS unset for a local Ray"
                ) from None
            if waited - told >= 30.0:
                logger.warning(
                    "waiting for Ray at %s (%.0f s of ray.startup_timeout_s=%g)", address, waited, timeout_s
                )
                told = waited
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


@contextlib.contextmanager
def ray_session(cfg: RayConfig) -> Iterator[dict[str, Any]]:
    """Attach to `ray.address` / RAY_ADDRESS, or start an embedded local Ray in a temp dir, torn down at exit
    (also on error or Ctrl-C). Yields a description of the session."""
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized():
        yield {"mode": "existing"}
        return
    if address:
        with console.phase(f"attaching to Ray at {address}"):
            wait_for_ray(address, cfg.startup_timeout_s)
            with console.children_to_log():
                ray.init(address=address, log_to_driver=True, configure_logging=console.verbose())
        try:
            yield {"mode": "attached", "address": address}
        finally:
            ray.shutdown()  # disconnects only; the cluster keeps running
        return
    # A short path: Ray's Unix sockets live under the temp dir and paths over ~107 bytes fail.
    tmp = tempfile.mkdtemp(prefix="vrl-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    before = _descendants()
    try:
        cpus = cfg.num_cpus or os.cpu_count()
        with console.phase(f"starting a local Ray ({cpus} CPUs, in {tmp})"), console.children_to_log():
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                _temp_dir=tmp,
                log_to_driver=True,
                configure_logging=console.verbose(),  # else Ray's lines go to libraries.log (console.libraries_to)
                logging_level=logging.WARNING,
            )
        yield {"mode": "embedded", "temp_dir": tmp}
    finally:
        started = _descendants() - before  # Ray's processes and its workers
        ray.shutdown()
        _wait_gone(started, RAY_EXIT_WAIT_S)
        shutil.rmtree(tmp, ignore_errors=True)


RAY_EXIT_WAIT_S = 15.0  # how long the end of a run waits for the processes of its local Ray to exit


def _descendants() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _wait_gone(pids: set[int], timeout: float) -> None:
    """`ray.shutdown` stops the local Ray's own processes; its workers (the engines) exit on their own once
    their raylet has gone, a killed one perhaps still on its way out. Waiting for them means nothing of the run
    is left running when `train` returns, and the engines' scratch folders can be removed after
    (rollout.scratch; a zombie counts as gone there and here: where PID 1 does not reap orphans, a container
    without an init, an engine that outlived its raylet stays one)."""
    deadline = time.monotonic() + timeout
    alive = sorted(pids)
    while True:
        alive = [pid for pid in alive if process_alive(pid)]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if alive:
        logger.warning("%d process(es) of the local Ray still running %.0f s after it stopped: %s",
                       len(alive), timeout, ", ".join(map(str, alive)))  # fmt: skip


# ---------------------------------------------------------------------------------------------- actors
