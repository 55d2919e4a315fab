"""What a run shows on the console: visionrl's own lines (the start-up phases with their times, then the progress
line), not the libraries'.

By default the libraries' output goes to a file of the run (`<output_dir>/libraries.log`) instead: every actor's
stdout and stderr (vLLM's, transformers', torch's, Python's and C's, and those of the processes an actor starts),
the processes Ray starts, and in this process Ray's, vLLM's and Python's warnings. `visionrl.log` beside it keeps
visionrl's own lines and the tracebacks of failures, readable (the libraries write terminal colours and progress
bars). `--verbose` (VISIONRL_VERBOSE=1) leaves the libraries' output on the console.
`phase` prints when a start-up phase begins and how long it took when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ACTOR_LOG_ENV = (
    "VISIONRL_ACTOR_LOG"  # set for the actors: the file their output is appended to (libraries.log)
)
VLLM_LOGGING_ENV = "VLLM_CONFIGURE_LOGGING"
VERBOSE_ENV = "VISIONRL_VERBOSE"  # "1": the libraries' output stays on the console
QUIETED = (
    "ray",
    "py.warnings",
    "vllm",
    "mlflow",
    "alembic",
    "wandb",
)  # this process's library loggers that go to the file

logger = logging.getLogger(__name__)


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def actor_env() -> dict[str, str]:
    """The environment an actor gets for the console (the log file its output goes to), {} when verbose."""
    path = os.environ.get(ACTOR_LOG_ENV)
    return {ACTOR_LOG_ENV: path} if path else {}


@contextlib.contextmanager
def libraries_to(log: Path) -> Iterator[None]:
    """While the block runs (unless verbose): the actors it starts append their output to `log`, and this process's
    Ray, vLLM and Python warnings go there too. Restores everything at its end."""
    if verbose():
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in map(logging.getLogger, QUIETED)]
    before = os.environ.get(ACTOR_LOG_ENV)
    # vLLM installs its own console handler on the "vllm" logger when it is first imported (an engine built in
    # this process, e.g. the demo's evaluation): told not to, its lines keep going to the file
    configure = os.environ.get(VLLM_LOGGING_ENV)
    os.environ[VLLM_LOGGING_ENV] = "0"
    logging.captureWarnings(True)
    for lg, _, _ in saved:
        lg.handlers, lg.propagate = [handler], False
    os.environ[ACTOR_LOG_ENV] = str(log.resolve())
    try:
        yield
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        logging.captureWarnings(False)
        for key, value in ((ACTOR_LOG_ENV, before), (VLLM_LOGGING_ENV, configure)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        handler.close()


def quiet_actor() -> None:
    """First thing in an actor: its stdout and stderr appended to the run's libraries.log when the driver asked for it
    (file descriptors 1 and 2, so C libraries and child processes write there too)."""
    path = os.environ.get(ACTOR_LOG_ENV)
    if not path:
        return
    try:
        _stdio_to(path)
    except OSError as err:  # the run directory not reachable from this node: keep Ray's own log files
        logger.warning("the actor's output stays in Ray's logs: %s cannot be opened here (%s)", path, err)


def _stdio_to(path: str) -> None:
    """File descriptors 1 and 2 of this process appended to `path` (what is buffered is written out first)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def children_to_log() -> Iterator[None]:
    """While the block runs (unless verbose), this process's file descriptors 1 and 2 point at the libraries' log,
    so the processes it starts (Ray's daemons at `ray.init`) write there for their whole life; restored after."""
    path = os.environ.get(ACTOR_LOG_ENV)
    if not path:
        yield
        return
    saved = os.dup(1), os.dup(2)
    _stdio_to(path)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, original in zip((1, 2), saved, strict=True):
            os.dup2(original, target)
            os.close(original)


@contextlib.contextmanager
def phase(what: str, done: str = "ready") -> Iterator[None]:
    """`[visionrl] <what> ...` when the phase begins and `[visionrl] <what>: <done> in N s` when it ends."""
    logger.info("%s ...", what)
    t0 = time.perf_counter()
    yield
    logger.info("%s: %s in %.1f s", what, done, time.perf_counter() - t0)
