"""The environments of multi-turn episodes, in Ray actors (`env.num_workers`): one env object per episode, each
call with the deadline `env.step_timeout_s` (`envs.pool`). A failed call ends that episode alone (reward 0,
counted); the step and the run go on."""

from __future__ import annotations

import zlib
from typing import Any

import ray

from visionrl.envs.base import Observation, StepResult
from visionrl.envs.episodes import MAX_ENV_THREADS
from visionrl.envs.pool import EnvFailure, EnvSet
from visionrl.envs.registry import env_factory
from visionrl.orchestrate import console
from visionrl.orchestrate.remote import Call, gather, kill_actors

ENV = "env worker"
RAY_SLACK_S = 60.0  # beyond the calls' own deadline: the actor's time to answer


@ray.remote
class EnvActor:
    """One env worker: the environments of the episodes routed to it (`EnvSet`)."""

    def __init__(self, env_cfg: Any, index: int) -> None:
        console.quiet_actor()
        self.envs = EnvSet(env_factory(env_cfg), env_cfg.step_timeout_s)
        self.index = index

    def reset(self, items: list[tuple[str, dict[str, Any]]]) -> list[Observation | EnvFailure]:
        return self.envs.reset(items)

    def step(self, items: list[tuple[str, str]]) -> list[StepResult | EnvFailure]:
        return self.envs.step(items)

    def close(self, keys: list[str]) -> int:
        return self.envs.close(keys)


class EnvPool:
    """The env workers, seen as one: each episode always goes to the same worker (its key's hash)."""

    def __init__(self, env_cfg: Any) -> None:
        from visionrl.orchestrate.scheduling import with_actor_env

        self.cfg = env_cfg
        # Threaded actors: continuous episodes send each episode's step on its own, and a worker's slow
        # environment must not queue its other episodes' calls behind it (EnvSet's calls are per key).
        opts: list[dict[str, Any]] = [
            {"num_cpus": 0, "max_concurrency": MAX_ENV_THREADS} for _ in range(env_cfg.num_workers)
        ]
        with_actor_env(opts)
        self.actors = [
            EnvActor.options(**o).remote(env_cfg, i)  # type: ignore[attr-defined]
            for i, o in enumerate(opts)
        ]

    def _worker(self, key: str) -> int:
        return zlib.crc32(key.encode()) % len(self.actors)

    def _fan_out(self, method: str, items: list[tuple[str, Any]]) -> list[Any]:
        parts: dict[int, list[int]] = {}
        for i, (key, _) in enumerate(items):
            parts.setdefault(self._worker(key), []).append(i)
        calls = [
            Call(getattr(self.actors[w], method).remote([items[i] for i in idx]), ENV, w)
            for w, idx in parts.items()
        ]
        got = gather(
            calls, f"environment {method}", self.cfg.step_timeout_s + RAY_SLACK_S, "env.step_timeout_s"
        )
        out: list[Any] = [None] * len(items)
        for (_, idx), results in zip(parts.items(), got, strict=True):
            for i, result in zip(idx, results, strict=True):
                out[i] = result
        return out

    def reset(self, items: list[tuple[str, dict[str, Any]]]) -> list[Observation | EnvFailure]:
        return self._fan_out("reset", items)

    def step(self, items: list[tuple[str, str]]) -> list[StepResult | EnvFailure]:
        return self._fan_out("step", items)

    def close(self, keys: list[str]) -> None:
        parts: dict[int, list[str]] = {}
        for key in keys:
            parts.setdefault(self._worker(key), []).append(key)
        calls = [Call(self.actors[w].close.remote(ks), ENV, w) for w, ks in parts.items()]
        gather(calls, "environment close", self.cfg.step_timeout_s + RAY_SLACK_S, "env.step_timeout_s")

    def kill(self) -> None:
        kill_actors(self.actors)
