"""The learner ranks seen by the loop as one learner: `LearnerGroup`, a typed method for each `LearnerActor` method.

Every learner method the loop uses (the train step, the adapter payload for engines or checkpoints, the probe
payload, saving and loading the state, log-probs) holds collectives when there are several ranks (summed
gradients and metrics; with FSDP the gathered adapter and optimizer state), so each call goes to every rank at
once, under one deadline (ray.call_timeout_s), and rank 0's result stands for the group (the others return None).
A rank that fails or hangs is named by its index; the learner is never restarted (its optimizer state lives only
there), so the run stops with the checkpoint to resume from.

Two kinds of method: most wait and return the result; the `..._pending` ones return a `Pending` at once, whose
`ref` (rank 0's result, still in the object store) goes to the engines as it is and whose `calls` the caller
waits for together with the engines' calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import ray

from visionrl.orchestrate.remote import LEARNER, ActorFailed, Call, gather
from visionrl.types import AdapterPayload

if TYPE_CHECKING:
    from visionrl.train.learner import TrainBatch
    from visionrl.train.learner_state import LearnerState

CALL_KEY = "ray.call_timeout_s"
DEATH_GRACE_S = 10.0  # how long a rank's failure waits for news of another rank's death
T = TypeVar("T")


@dataclass(frozen=True)
class Pending(Generic[T]):
    """A learner call in flight on every rank, its result of type T."""

    ref: Any  # the ObjectRef of rank 0's result: hand it to engines as it is (resolved once, in the store)
    calls: list[Call]  # every rank's call, rank 0's first: wait for all of them (each rank takes part)


class LearnerGroup:
    """`ray.num_learners` LearnerActors (rank i at index i), called as one learner."""

    def __init__(self, actors: list[Any], timeout_s: float) -> None:
        self.actors, self.timeout_s = actors, timeout_s

    def __len__(self) -> int:
        return len(self.actors)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The update on `batch`: its metrics, summed over the ranks already."""
        return self._wait("update", self._start(lambda a: a.train_step.remote(batch)))

    def adapter_payload(self, phase: str, *, for_engine: bool) -> AdapterPayload:
        """The current adapter (`for_engine=False`: in full precision), for the driver to write."""
        return self._wait(phase, self._start(lambda a: a.adapter_payload.remote(for_engine)))

    def adapter_payload_pending(self) -> Pending[AdapterPayload]:
        """The current adapter for the engines, started on every rank."""
        return self._pending(self._start(lambda a: a.adapter_payload.remote(True)))

    def probe_parts(self) -> list[str]:
        """The adapter parts this run has (`train.probe`): each is probed on its own."""
        return self._wait("the adapter probe", self._start(lambda a: a.probe_parts.remote()))

    def probe_payload_pending(self, part: str) -> Pending[AdapterPayload]:
        """The probe adapter of `part` (version -1: random B on that part only) for the engines, started."""
        return self._pending(self._start(lambda a: a.probe_payload.remote(part)))

    def probe_logprobs(self, part: str, batch: TrainBatch) -> tuple[list[list[float]], list[list[float]]]:
        """Log-probs of the engines' greedy probe completions under the probe adapter of `part`, and under the
        learner's own weights."""
        return self._wait("the adapter probe", self._start(lambda a: a.probe_logprobs.remote(part, batch)))

    def save(self) -> LearnerState:
        """What a checkpoint keeps: the adapter in full precision and the trainer state."""
        return self._wait("checkpoint", self._start(lambda a: a.save.remote()))

    def load(self, adapter_dir: Path, trainer_state: bytes) -> None:
        """Every rank restores the adapter in `adapter_dir` and the trainer state of a checkpoint."""
        self._wait("resume", self._start(lambda a: a.load.remote(str(adapter_dir), trainer_state)))

    def logprobs(
        self, batch: TrainBatch, adapter: bool = True, temperature: float | None = None
    ) -> list[list[float]]:
        """Log-probs of every sequence's completion tokens, with the adapter or (`adapter=False`) the base model,
        at the sampling temperature unless `temperature` is given (1 for greedy completions)."""
        return self._wait("log-probs", self._start(lambda a: a.logprobs.remote(batch, adapter, temperature)))

    def raw_logprobs_pending(self, batch: TrainBatch) -> Pending[list[list[float]]]:
        """`logprobs` at temperature 1 over the whole vocabulary (no vision token removed), started."""
        return self._pending(self._start(lambda a: a.logprobs.remote(batch, True, 1.0, True)))

    def _start(self, method: Callable[[Any], Any]) -> list[Call]:
        return [Call(method(actor), LEARNER, i) for i, actor in enumerate(self.actors)]

    @staticmethod
    def _pending(calls: list[Call]) -> Pending[Any]:
        return Pending(calls[0].ref, calls)

    def _wait(self, phase: str, calls: list[Call]) -> Any:
        """Every rank's call waited for under one deadline; rank 0's result."""
        try:
            return gather(calls, phase, self.timeout_s, CALL_KEY)[0]
        except ActorFailed as failed:
            raise _first_death(failed, calls, phase) from failed.__cause__


def _first_death(failed: ActorFailed, calls: list[Call], phase: str) -> ActorFailed:
    """When one rank dies, the others may fail in their next collective at about the same moment (their peer
    is gone): report the rank that died, the cause, rather than whichever failure arrived first."""
    if failed.died:
        return failed
    others = [c for c in calls if c.index != failed.index]
    ready, _ = ray.wait([c.ref for c in others], num_returns=len(others), timeout=DEATH_GRACE_S)
    for call in others:
        if call.ref in ready:
            try:
                ray.get(call.ref)
            except ray.exceptions.RayActorError as err:
                return ActorFailed(LEARNER, call.index, phase, err)
            except ray.exceptions.RayTaskError:
                continue
    return failed
