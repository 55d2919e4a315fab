"""A rollout actor seen from the driver as an engine: its stepping API (`types.SteppingEngine`) as the lane of
continuous episodes on one engine (`envs.continuous`), its calls with the loop's deadline, and a restarted engine
given the lane's requests in flight again; and its `generate` as a plain engine's (`RemoteEngine`, for evaluation).

Ray actor calls are coarse: `submit` returns at once, `collect` waits at most a short time in the actor (which
takes no other call meanwhile) and returns whatever finished; the driver submits the answered episodes' turns in
between, so the engine's running batch never waits on the driver for more than one short wait."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from visionrl.orchestrate.remote import ENGINE, ActorProblem, Call
from visionrl.types import Completion, PromptItem, SamplingSpec

ENGINE_SEED_STRIDE = 1_000_003  # engines draw from disjoint seed streams: no two samples share noise


def engine_spec(spec: SamplingSpec, engine: int) -> SamplingSpec:
    return spec if spec.seed is None else replace(spec, seed=spec.seed + ENGINE_SEED_STRIDE * engine)


class EngineLane:
    """Engine `index` of `workers` (a `Workers`) as a `SteppingEngine`. What was submitted and not collected is
    kept: an engine that died or hung is restarted (`Workers._restart`: counted, the adapter re-synced and
    verified) and those prompts are submitted again, so the episodes go on where they were."""

    def __init__(self, workers: Any, index: int) -> None:
        self.workers, self.index = workers, index
        self._pending: dict[str, tuple[PromptItem, SamplingSpec]] = {}  # our id -> what was submitted
        self._engine_ids: dict[str, str] = {}  # the engine's id -> ours
        self._ids = itertools.count(1)

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        ours = [f"lane{self.index}-{next(self._ids)}" for _ in prompts]
        for rid, p in zip(ours, prompts, strict=True):
            self._pending[rid] = (p, replace(spec, seed=None))  # a resubmission never reseeds
        try:
            self._send(ours, prompts, engine_spec(spec, self.index))
        except ActorProblem as problem:
            self._recover(problem)
        return ours

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        try:
            got: dict[str, list[Completion]] = self._call("collect", timeout_s)
        except ActorProblem as problem:
            self._recover(problem)
            return {}
        done = {}
        for engine_id, group in got.items():
            rid = self._engine_ids.pop(engine_id)
            del self._pending[rid]
            done[rid] = group
        return done

    def abort(self) -> int:
        """Drop the lane's requests (after a failed step). An engine that is gone holds none: 0."""
        self._pending, self._engine_ids = {}, {}
        try:
            return int(self._call("abort"))
        except ActorProblem:  # the failure being raised is the step's; a dead engine has nothing in flight
            return 0

    def _send(self, ours: list[str], prompts: list[PromptItem], spec: SamplingSpec) -> None:
        theirs = self._call("submit", prompts, spec)
        self._engine_ids.update(zip(theirs, ours, strict=True))

    def _call(self, method: str, *args: Any) -> Any:
        w = self.workers
        ref = getattr(w.engines[self.index], method).remote(*args)
        return w._get([Call(ref, ENGINE, self.index)], "rollout", True)[0]

    def _recover(self, problem: ActorProblem) -> None:
        """Restart the engine (or raise, as `Workers._recovering` would) and submit everything pending again."""
        while True:
            self.workers._restart(problem)
            self._engine_ids = {}
            by_spec: dict[str, tuple[SamplingSpec, list[str]]] = {}
            for rid, (_, spec) in self._pending.items():
                by_spec.setdefault(repr(spec), (spec, []))[1].append(rid)
            try:
                for spec, ids in by_spec.values():
                    self._send(ids, [self._pending[rid][0] for rid in ids], spec)
                return
            except ActorProblem as again:  # the restarted engine failed too: restarted again, if allowed
                problem = again


class RemoteEngine:
    """Engine 0 of `workers` (a `Workers`) as a plain engine (for the shared evaluation code), with the loop's
    deadline, restarted like the others."""

    def __init__(self, workers: Any) -> None:
        self.workers = workers

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        w = self.workers
        return w._recovering(
            lambda: w._get([Call(w.engines[0].generate.remote(prompts, spec), ENGINE, 0)], "eval", True)[0]
        )
