"""Waiting on remote calls with a deadline, and knowing which actor a failure came from.

Every remote call the loop waits on goes through `gather`: each call is tagged with the actor's role and index
and the phase of the step, so a failure names them (`ActorFailed`, with the exception raised inside the actor
and its traceback) and a call past its deadline names the stuck actor (`ActorHung`) instead of waiting
forever. While a stop was requested (SIGTERM/SIGINT, `visionrl.orchestrate.preemption`), an interruptible wait
gives up at once with `Preempted`.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from visionrl.errors import OutOfMemory
from visionrl.orchestrate import preemption

T = TypeVar("T")
LEARNER, ENGINE, REWARD, JUDGE = "learner", "rollout engine", "reward worker", "judge"
POLL_S = 0.5  # how often an interruptible wait looks for a stop request
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the traceback's header line


@dataclass(frozen=True)
class Call:
    """One remote call in flight: its object ref and the actor that runs it."""

    ref: Any
    role: str  # LEARNER, ENGINE or REWARD
    index: int


class ActorProblem(Exception):
    """A remote call failed or hung; says which actor, in which phase. The loop turns it into a RunError (with
    the checkpoint hint), or `Workers` restarts the actor and retries."""

    def __init__(self, role: str, index: int, phase: str, message: str) -> None:
        super().__init__(message)
        self.role, self.index, self.phase = role, index, phase

    @property
    def actor(self) -> str:
        return f"{self.role} {self.index}"


class ActorFailed(ActorProblem):
    """The actor raised (`cause` is its exception) or died (`cause` is None)."""

    def __init__(self, role: str, index: int, phase: str, err: BaseException) -> None:
        cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
        self.cause: BaseException | None = cause if isinstance(cause, BaseException) else None
        self.died = isinstance(err, ray.exceptions.RayActorError)
        # Calls to an actor Ray is rebuilding (max_restarts) fail with this until it is back.
        self.unavailable = isinstance(err, ray.exceptions.ActorUnavailableError)
        # The remote traceback: str() of Ray's error (its `traceback_str` is not reachable on the subclass of
        # the cause's type that ray.get raises).
        # An exception in the actor's __init__ reaches us only as text inside Ray's ActorDiedError: the remote
        # traceback, whose last line is the original "Type: message".
        self.init_error = _init_error(err)
        self.traceback = _ANSI.sub("", str(err)) if self.cause is not None or self.init_error else ""
        super().__init__(role, index, phase, self._describe(role, index, phase, err))

    def _describe(self, role: str, index: int, phase: str, err: BaseException) -> str:
        if isinstance(self.cause, OutOfMemory):
            return str(self.cause)  # names actor, phase, memory figures and the keys to change
        if self.cause is not None:
            what = f"{type(self.cause).__name__}: {first_line(self.cause)}"
            return f"the {role} {index} failed during {phase}: {what}\nTo fix: {advice(role, phase)}"
        if self.init_error:
            return (
                f"the {role} {index} failed during {phase}: {self.init_error}\nTo fix: {advice(role, phase)}"
            )
        if self.died:
            return (
                f"the {role} {index} died during {phase} ({first_line(err)}): its process was killed (out of "
                "host memory, the node lost, or killed from outside) or crashed in native code.\nTo fix: look "
                "for the reason in the Ray logs of that node (raylet.out; dmesg for the kernel's OOM killer)"
            )
        return f"the {role} {index} failed during {phase}: {type(err).__name__}: {first_line(err)}"


def _init_error(err: BaseException) -> str:
    """ "Type: message" of an exception raised in an actor's constructor, from Ray's ActorDiedError; else ""."""
    if not (isinstance(err, ray.exceptions.RayActorError) and err.actor_init_failed):
        return ""
    lines = [ln.strip() for ln in _ANSI.sub("", str(err)).splitlines() if ln.strip()]
    found = [i for i, ln in enumerate(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", ln)]
    if not found:
        return ""
    # the message may go on (pydantic puts the reason on the next lines): up to two more lines
    rest = [ln for ln in lines[found[-1] + 1 : found[-1] + 3] if not ln.startswith(("File ", "For further"))]
    return " ".join([lines[found[-1]], *rest])


class ActorHung(ActorProblem):
    """The call did not return within its deadline."""

    def __init__(self, role: str, index: int, phase: str, timeout_s: float, key: str) -> None:
        super().__init__(
            role,
            index,
            phase,
            f"the {role} {index} did not answer within {timeout_s:g} s during {phase} ({key}): it is stuck (a "
            "frozen engine, a hung collective, a reward holding the GIL) and was stopped.\nTo fix: if such calls "
            f"are legitimately slower, raise {key}; otherwise look at that actor's log for where it hangs"
            + (_GIL_HINT if role == REWARD else ""),
        )


_GIL_HINT = (
    "; with ray.reward_isolation=thread a reward function that never releases the GIL (a C loop, a "
    "catastrophic regular expression) stalls the whole worker: set ray.reward_isolation=process"
)


# What to try for an exception raised inside an actor, by phase (the exception's own message comes first).
_ADVICE = {
    "rollout": "the engine refused a prompt or broke while generating: a prompt longer than "
    "rollout.max_model_len, more images than the engine allows (data.max_images_per_prompt), or an engine bug; "
    "fix the data or raise the limit named above",
    "reward": "the reward worker itself failed (reward functions' own errors are counted, not raised)",
}
_ADVICE["the adapter probe"] = _ADVICE["the adapter fingerprint"] = _ADVICE["eval"] = _ADVICE[
    "rollout"
]  # the engine generates in these too


def advice(role: str, phase: str) -> str:
    return _ADVICE.get(
        phase, f"fix the cause above (the {role}'s full traceback is in the run's log file), then resume"
    )


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def gather(
    calls: list[Call], phase: str, timeout_s: float, key: str, interruptible: bool = False
) -> list[Any]:
    """The results of `calls` in order. Raises ActorFailed for the first call that failed (whichever finishes
    first), ActorHung naming the first unfinished call at the deadline (`key` is the config key that set it),
    and, if `interruptible`, Preempted as soon as a stop was requested."""
    deadline = time.monotonic() + timeout_s
    pending = {c.ref: i for i, c in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    while pending:
        if interruptible:
            preemption.raise_if_requested()
        left = deadline - time.monotonic()
        if left <= 0:
            first = calls[min(pending.values())]
            raise ActorHung(first.role, first.index, phase, timeout_s, key)
        wait_s = min(left, POLL_S) if interruptible else left
        # One at a time: a failure is seen as soon as it happens, not after the slowest call.
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        for ref in ready:
            i = pending.pop(ref)
            try:
                results[i] = ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                raise ActorFailed(calls[i].role, calls[i].index, phase, err) from err
    return results


def split_evenly(items: list[T], parts: int) -> list[list[T]]:
    """`items` as `parts` consecutive runs whose lengths differ by at most one (the first ones longer), some of them
    empty when there are fewer items than parts: a batch fanned out over actors, in order."""
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


def wait_until_back(actor: Any, role: str, index: int, timeout_s: float, key: str) -> dict[str, Any]:
    """The placement of an actor that Ray is restarting, once it answers. While it is rebuilt its calls fail as
    unavailable; after `timeout_s` (the config key `key`), or on any other failure, the failure is raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            return gather([Call(actor.placement.remote(), role, index)], "restart", left, key)[0]
        except ActorFailed as failed:
            if not failed.unavailable or time.monotonic() >= deadline:
                raise
        time.sleep(1.0)


def kill_actors(actors: list[Any]) -> None:
    """Stop `actors` at once (no restart), e.g. those of a failed run: on a Ray that outlives the run (attached,
    or already running in this process) they would otherwise live on while anything holds their handles, such
    as a logged traceback."""
    for actor in actors:
        with contextlib.suppress(Exception):  # one already gone
            ray.kill(actor)
