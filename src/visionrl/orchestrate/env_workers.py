"""The environments of multi-turn episodes, in Ray actors (`env.num_workers`): one env object per episode, each
call (`reset`, `step`) with the deadline `env.step_timeout_s`. A call that raises, returns the wrong type or a
non-finite reward, or overruns its deadline comes back as an `EnvFailure` for that episode alone: the episode ends
with reward 0 and is counted, the step and the run go on. Calls of one batch run concurrently (a thread each), so
a slow environment costs the batch one deadline, not one per episode."""

from __future__ import annotations

import math
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import ray

from visionrl.envs.base import Env, Observation, StepResult
from visionrl.envs.registry import env_factory
from visionrl.orchestrate import console
from visionrl.orchestrate.remote import Call, gather, kill_actors

T = TypeVar("T")
ENV = "env worker"
RAY_SLACK_S = 60.0  # beyond the calls' own deadline: the actor's time to answer


@dataclass(frozen=True)
class EnvFailure:
    """Why an environment call gave no result: `kind` error or timeout, and the message."""

    kind: str
    message: str


def with_deadline(calls: list[Callable[[], T]], timeout_s: float) -> list[T | EnvFailure]:
    """Each call run in a thread of its own, all at once; a call still running after `timeout_s` is a timeout (its
    thread is left to finish: Python cannot stop it), one that raises an error with its message."""
    results: list[T | EnvFailure] = [EnvFailure("timeout", f"no answer within {timeout_s:g} s")] * len(calls)

    def run(i: int, call: Callable[[], T]) -> None:
        try:
            results[i] = call()
        except Exception as err:  # the user's environment failed: that episode ends, counted
            results[i] = EnvFailure("error", f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)]
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    return list(results)


def _checked(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        return EnvFailure("error", f"{what} returned {type(value).__name__}, not a {kind.__name__}")
    if isinstance(value, StepResult) and not math.isfinite(float(value.reward)):
        return EnvFailure("error", f"{what} returned a non-finite reward ({value.reward})")
    return value


@ray.remote
class EnvActor:
    def __init__(self, env_cfg: Any, index: int) -> None:
        console.quiet_actor()
        self.make: Callable[[], Env] = env_factory(env_cfg)
        self.timeout_s = env_cfg.step_timeout_s
        self.index = index
        self.envs: dict[str, Env] = {}

    def reset(self, items: list[tuple[str, dict[str, Any]]]) -> list[Observation | EnvFailure]:
        def start(key: str, record: dict[str, Any]) -> Any:
            self.envs[key] = env = self.make()
            return _checked(env.reset(record), Observation, "reset")

        return self._run([partial(start, k, r) for k, r in items], [k for k, _ in items])

    def step(self, items: list[tuple[str, str]]) -> list[StepResult | EnvFailure]:
        def one(key: str, action: str) -> Any:
            return _checked(self.envs[key].step(action), StepResult, "step")

        return self._run([partial(one, k, a) for k, a in items], [k for k, _ in items])

    def _run(self, calls: list[Callable[[], Any]], keys: list[str]) -> list[Any]:
        results = with_deadline(calls, self.timeout_s)
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, EnvFailure):  # that episode is over; its env is not called again
                self.envs.pop(key, None)
        return results

    def close(self, keys: list[str]) -> int:
        """Close the episodes' environments (each with the deadline; failures ignored); returns how many."""
        envs = [self.envs.pop(k) for k in keys if k in self.envs]
        with_deadline([env.close for env in envs], self.timeout_s)
        return len(envs)


class EnvPool:
    """The env workers, seen as one: each episode always goes to the same worker (its key's hash)."""

    def __init__(self, env_cfg: Any) -> None:
        from visionrl.orchestrate.actors import with_actor_env

        self.cfg = env_cfg
        opts: list[dict[str, Any]] = [{"num_cpus": 0} for _ in range(env_cfg.num_workers)]
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
