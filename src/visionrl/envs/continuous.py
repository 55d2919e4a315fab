"""Continuous episodes (`env.pipeline: continuous`): an episode's next turn joins the engine's running batch as soon
as its environment answers, so environment time overlaps generation.

A lane submits every episode's first turn to its engine (a `SteppingEngine`); whenever turns finish, those
episodes' environments step, each episode's call on a thread of its own (a slow environment holds its episode
alone), and each answer submits that episode's next turn at once. The bookkeeping is the turn-by-turn pipeline's
(`EpisodeRunner.fits`, `take_turn`, `after_step`): for the same sampled turns an episode's tokens, masks, rewards
and ending are the same. What differs is the noise: the engine is seeded once, when the lane's first turns go in,
and a later turn draws from the running stream at whatever point it joins (greedy episodes are unaffected)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import replace
from typing import Any, Protocol

from visionrl.envs.trajectory import Episode
from visionrl.types import Completion, SamplingSpec, SteppingEngine

# collect's wait while environments step: an answer waits at most this long to join the batch, unless the engine
# can be woken (`wake`: an engine in this process); a Ray actor's collect cannot, as it takes one call at a time
POLL_S = 0.02
IDLE_S = 1.0  # collect's wait while none steps (it returns as soon as any turn finishes anyway)


class EpisodeRules(Protocol):
    """What a lane needs of `EpisodeRunner` (which imports this module): its env pool and its turn bookkeeping."""

    pool: Any

    def fits(self, e: Episode, spec: SamplingSpec) -> bool: ...

    def take_turn(self, e: Episode, group: list[Completion]) -> bool: ...

    def after_step(self, e: Episode, result: Any) -> None: ...


def play(
    runner: EpisodeRules,
    part: list[Episode],
    engine: SteppingEngine,
    spec: SamplingSpec,
    env_threads: Executor,
) -> float:
    """`part`'s episodes to their end on `engine`; returns the lane's environment time (the wall time during which
    at least one of its environment calls ran). On a failure the engine's requests in flight are aborted."""
    lane = _Lane(runner, engine, spec, env_threads)
    try:
        lane.run(part)
    except BaseException:
        engine.abort()  # nothing of this step may be left in the engine for the next one to collect
        raise
    return lane.env_s


class _Lane:
    """One engine's episodes: those in the engine (by request id), those whose environment steps, those ready."""

    def __init__(
        self, runner: EpisodeRules, engine: SteppingEngine, spec: SamplingSpec, env_threads: Executor
    ) -> None:
        self.runner, self.engine, self.spec, self.env_threads = runner, engine, spec, env_threads
        self.in_engine: dict[str, Episode] = {}
        self.stepping: dict[Future[Any], Episode] = {}
        self.ready: list[Episode] = []
        self.env_s, self._env_since = 0.0, 0.0
        wake = getattr(engine, "wake", None)  # optional: an engine in this process, woken by an answer
        self.wake: Callable[[Any], None] | None = None if wake is None else lambda _: wake()

    def run(self, part: list[Episode]) -> None:
        self.ready = list(part)
        while True:
            self._submit()
            if not self.in_engine and not self.stepping:
                return
            if self.in_engine:
                # short while an answer may arrive (it must not wait long to rejoin), else long
                self._turns_done(self.engine.collect(POLL_S if self.stepping else IDLE_S))
            else:
                wait(list(self.stepping), return_when=FIRST_COMPLETED)
            self._answers()

    def _submit(self) -> None:
        going = [e for e in self.ready if self.runner.fits(e, self.spec)]
        self.ready = []
        if going:
            ids = self.engine.submit([e.engine_prompt() for e in going], self.spec)
            self.spec = replace(self.spec, seed=None)  # seeded once: later turns join a running stream
            self.in_engine.update(zip(ids, going, strict=True))

    def _turns_done(self, finished: dict[str, list[Completion]]) -> None:
        for rid, group in finished.items():
            e = self.in_engine.pop(rid)
            if self.runner.take_turn(e, group):
                if not self.stepping:
                    self._env_since = time.perf_counter()
                call = self.env_threads.submit(self.runner.pool.step, [(e.key, e.last_text)])
                if self.wake is not None:
                    call.add_done_callback(self.wake)
                self.stepping[call] = e

    def _answers(self) -> None:
        for call in [c for c in self.stepping if c.done()]:
            e = self.stepping.pop(call)
            self.runner.after_step(e, call.result()[0])  # an env worker's own failure raises here
            if not e.done:
                self.ready.append(e)
        if not self.stepping and self._env_since:
            self.env_s += time.perf_counter() - self._env_since
            self._env_since = 0.0
