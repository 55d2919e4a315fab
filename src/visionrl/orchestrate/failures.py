"""What the user sees when a run fails or is stopped: the cause, where to continue from, and the run's log file.

The console gets one message (actor role and index, phase, the exception raised inside the actor, what to
do, the checkpoint to resume from); `<output_dir>/visionrl.log` gets visionrl's log lines of the run and
the full remote traceback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from visionrl.checkpoint import latest_checkpoint
from visionrl.errors import OutOfMemory, Preempted, RunError
from visionrl.orchestrate.remote import ActorFailed, ActorProblem, first_line
from visionrl.run_layout import RunDir

logger = logging.getLogger(__name__)
# For the run's log file only (not propagated to visionrl's console handler): tracebacks and the final error.
file_only = logging.getLogger("visionrl-run-file")
file_only.propagate = False
file_only.setLevel(logging.INFO)


@contextlib.contextmanager
def run_log(run: RunDir) -> Iterator[Path]:
    """visionrl's log lines (INFO and up) also go to the run's log file, appended, while the block runs."""
    run.root.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run.log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("visionrl")
    level = root.level
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)
    root.addHandler(handler)
    file_only.addHandler(handler)
    try:
        yield run.log
    finally:
        file_only.removeHandler(handler)
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def resume_hint(run: Path) -> str:
    ckpt = latest_checkpoint(run)
    if ckpt is None:
        return "no checkpoint was written yet"
    return f"the newest checkpoint is {ckpt}; continue with `visionrl train CONFIG --resume auto`"


def run_error(err: BaseException, run: Path) -> RunError:
    """The RunError for a failed actor: the cause raised inside it (not Ray's wrapper), what to do, and where
    to resume from; the remote traceback goes to the log (the run's log file while `run_log` is active)."""
    failure = _run_error(err, run)
    file_only.error("the run failed:\n%s", failure)
    return failure


def _run_error(err: BaseException, run: Path) -> RunError:
    where = resume_hint(run)
    traceback = err.traceback if isinstance(err, ActorFailed) else ""
    if isinstance(err, ActorFailed) and traceback:
        file_only.error("%s failed during %s; its traceback:\n%s", err.actor, err.phase, traceback)
    log = f"\nThe full traceback is in {RunDir(run).log}." if traceback else ""
    if isinstance(err, ActorProblem):
        cause = err.cause if isinstance(err, ActorFailed) else None
        kind = OutOfMemory if isinstance(cause, OutOfMemory) else RunError
        return kind(f"{err}{log}\n{where}")
    cause = getattr(err, "cause", None)  # a RayTaskError carries the exception raised inside the actor
    if isinstance(cause, OutOfMemory):
        return OutOfMemory(f"{cause}\n{where}")
    if isinstance(cause, BaseException):
        return RunError(f"a worker of the run failed: {type(cause).__name__}: {first_line(cause)}\n{where}")
    return RunError(f"a worker of the run failed: {first_line(err)}\n{where}")


def stopped(stop: Preempted, run: Path, saved: int | None) -> Preempted:
    """The Preempted error the CLI prints: which signal, which step was saved, how to continue."""
    what = (
        f"checkpointed step {saved}" if saved is not None else "no new checkpoint (no step completed since)"
    )
    return Preempted(stop.signum, f"interrupted by {stop.signal_name}: {what}; {resume_hint(run)}")
