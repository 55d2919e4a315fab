"""The learner ranks seen by the loop as one learner.

Every Learner method the loop uses (train_step, adapter_payload, probe_payload, state_dict, load_state) holds collectives when there are several ranks (summed gradients and metrics; with FSDP the
gathered adapter and optimizer state), so each call goes to every rank at once, under one deadline, and rank 0's
result stands for the group (the others return None: `LearnerActor.call`). A rank that fails or hangs is named
by its index; the learner is never restarted (its optimizer state lives only there), so the run stops with the
checkpoint to resume from.
"""

from __future__ import annotations

from typing import Any

import ray

from visionrl.orchestrate.remote import LEARNER, ActorFailed, Call, gather

CALL_KEY = "ray.call_timeout_s"
DEATH_GRACE_S = 10.0  # how long a rank's failure waits for news of another rank's death


class LearnerGroup:
    """`ray.num_learners` LearnerActors (rank i at index i)."""

    def __init__(self, actors: list[Any], timeout_s: float) -> None:
        self.actors, self.timeout_s = actors, timeout_s

    def __len__(self) -> int:
        return len(self.actors)

    def start(self, method: str, *args: Any) -> tuple[Any, list[Call]]:
        """Start `method` on every rank: (rank 0's result ref, to hand to engines as it is, and every rank's
        call, which the caller must wait for too)."""
        calls = [Call(a.call.remote(method, *args), LEARNER, i) for i, a in enumerate(self.actors)]
        return calls[0].ref, calls

    def call(self, phase: str, method: str, *args: Any) -> Any:
        """`method` on every rank, waited for (ray.call_timeout_s); rank 0's result."""
        _, calls = self.start(method, *args)
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
