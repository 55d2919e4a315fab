"""One-step-off rollouts (`rollout.async_steps: 1`): the next step's batch is collected while the learner trains.

A step s of the loop with it:
  take batch s (collected during step s-1, or now)  ->  start collecting batch s+1 in the background, with the
  adapter the engines hold (version s-1)  ->  learner update on batch s (version s-1 -> s)  ->  wait for batch
  s+1  ->  sync version s to the engines  ->  log / evaluate / checkpoint (nothing is in flight by then).
So a batch is at most one version older than the learner that trains on it (`rollout/staleness`), the engines
never change version in the middle of a batch, and evaluation sees the learner's adapter as in synchronous runs.

Collecting (phases 1-3: prompts, rollouts, rewards, dynamic-sampling rounds) runs in one background thread of the
driver: it only issues and waits on Ray calls to the engines and reward workers (the GIL is released while it
waits), while the main thread waits on the learner. A thread, not bare object refs, so the whole of phases 1-3
(rejected prompts, extra sampling rounds, reward scoring) overlaps the update with the same code as synchronous
steps.

Checkpoints: the data position saved after step s is the one before batch s+1 was drawn (`position`), so a
resumed run draws those prompts again. A step with a planned checkpoint (logging.save_every, the last step)
starts no prefetch: the next batch is then sampled with the checkpoint's own adapter, which is what a run
resumed from that checkpoint does too, so it continues exactly like the uninterrupted run.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, TypeVar

from visionrl.config import JobConfig
from visionrl.errors import Preempted

logger = logging.getLogger(__name__)
T = TypeVar("T")


def warn_about_async_steps(cfg: JobConfig) -> None:
    """The two ways `rollout.async_steps` is measured to go wrong. Engines colocated with the learner on the same
    GPUs share its device: rollouts and update then take turns anyway, and async_steps only adds staleness. And
    one-step-off batches with the learner's own log-probs as the old policy fell back to chance on 3 of 3 seeds
    where the engine's learned (benchmarks/NOTES-async.md)."""
    if cfg.rollout.async_steps and cfg.algorithm.old_logprobs == "learner":
        logger.warning(
            "rollout.async_steps=%d with algorithm.old_logprobs=learner: the PPO clip then bounds each update "
            "around the learner's current policy, not the one that sampled the stale batch; on the colour task "
            "at a constant lr of 3e-3 such runs fell back to chance on 3 of 3 seeds, while with the engine's "
            "log-probs all 3 learned. Set algorithm.old_logprobs=engine and algorithm.rollout_correction=off",
            cfg.rollout.async_steps,
        )
    if cfg.rollout.async_steps and cfg.ray.placement == "colocated" and cfg.rollout.gpus_per_engine > 0:
        logger.warning(
            "rollout.async_steps=%d with ray.placement=colocated on GPUs: engines and learner share the GPUs, so "
            "the next batch's rollouts cannot overlap the update much; use ray.placement=split",
            cfg.rollout.async_steps,
        )


class Prefetch(Generic[T]):
    """At most one collection in flight, for one named step."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._future: concurrent.futures.Future[T] | None = None
        self._step = 0
        # the data position before the prefetched batch was drawn: what a checkpoint of the step before saves
        self.position: dict[str, Any] | None = None

    def start(self, step: int, position: dict[str, Any], collect: Callable[[], T]) -> None:
        if self._future is not None:
            raise RuntimeError(
                f"a batch for step {self._step} is still in flight: take it before starting another"
            )
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="visionrl-prefetch")
        self._step, self.position = step, position
        self._future = self._pool.submit(collect)

    def wait(self) -> None:
        """Until the batch in flight is collected; its error is raised here. A stop request (Preempted) leaves
        no batch: the loop checkpoints the finished step with `position`, and the resumed run draws it again."""
        if self._future is None:
            return
        try:
            self._future.result()
        except Preempted:
            self._future = None

    def take(self, step: int) -> T | None:
        """The batch collected for `step`, or None if none was (then the loop collects it now)."""
        future, self._future = self._future, None
        ready = future is not None and self._step == step
        self.position = None
        return future.result() if ready and future is not None else None

    def __enter__(self) -> Prefetch[T]:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A collection still running when the run ends (an error elsewhere) is waited for, bounded by its own
        # call deadlines, so no Ray call outlives the Ray session; its result or error no longer matters.
        if self._future is not None:
            concurrent.futures.wait([self._future])
            if kind is not None and self._future.exception() is not None:
                logger.info("the prefetched batch was dropped: %s", self._future.exception())
        if self._pool is not None:
            self._pool.shutdown(wait=True)
