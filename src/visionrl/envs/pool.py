"""Running the environments of a batch of episodes: each call (`reset`, `step`, `close`) with the deadline
`env.step_timeout_s`, all calls of a batch at once (a thread each), so a slow environment costs the batch one
deadline, not one per episode. A call that raises, returns the wrong type or a non-finite reward, or overruns its
deadline comes back as an `EnvFailure` for that episode alone. `EnvSet` holds the episodes' environments of one
process: the env workers' (Ray actors, `orchestrate.env_workers`) or, as `LocalEnvs`, the caller's own (evaluation,
tests)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from visionrl.envs.base import Env, Observation, StepResult

T = TypeVar("T")


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


class EnvSet:
    """The environments of the episodes one process runs, by episode key; every call with the deadline."""

    def __init__(self, make: Callable[[], Env], timeout_s: float) -> None:
        self.make, self.timeout_s = make, timeout_s
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


class LocalEnvs(EnvSet):
    """The environments in the caller's process (the job's `env` section): for evaluation and tests."""

    def __init__(self, env_cfg: Any) -> None:
        from visionrl.envs.registry import env_factory

        super().__init__(env_factory(env_cfg), env_cfg.step_timeout_s)
