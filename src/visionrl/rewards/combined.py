"""The weighted sum of several rewards, scored per batch with per-call isolation and counters.

``build_reward_fn(specs)`` returns a ``CombinedReward``; ``score(completions, records)`` returns a
``RewardResult`` holding the weighted total per sample, every component unweighted, and how many calls
of each component raised, returned a non-number, or timed out (those score 0 and never stop the run).

A ``CombinedReward`` pickles as its specs and settings only: resolved functions and the worker
thread/process are rebuilt lazily on first use, so it can be shipped to Ray reward workers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from visionrl.rewards.isolation import Outcome, ProcessRunner, ThreadRunner
from visionrl.rewards.registry import RewardFn, RewardSpec, resolve_reward

Isolation = Literal["thread", "process"]


@dataclass
class RewardResult:
    """Scores of one batch of N completions.

    Attributes:
        total: [N] weighted sum of the components per sample.
        per_reward: component key -> [N] unweighted scores (0.0 where the call failed). The key is
            the spec name, or ``name#i`` (i-th occurrence) when a name appears more than once.
        num_errors: component key -> calls that raised or returned a non-finite / non-number value.
        num_timeouts: component key -> calls that exceeded the timeout.
        error_examples: component key -> the first failure message of this batch (only keys that failed).
        seconds: judge component key -> wall seconds its judging took (judges only: `orchestrate.judging`).
        verdicts: judge component key -> [N] the judge's short verdict per sample (e.g. "yes 0.93", "timeout").
    """

    total: list[float]
    per_reward: dict[str, list[float]]
    num_errors: dict[str, int] = field(default_factory=dict)
    num_timeouts: dict[str, int] = field(default_factory=dict)
    error_examples: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    verdicts: dict[str, list[str]] = field(default_factory=dict)


def component_keys(specs: Sequence[RewardSpec]) -> list[str]:
    """Result keys of ``specs``: the name, or ``name#i`` for the i-th of several specs with that name."""
    counts = Counter(spec.name for spec in specs)
    seen: Counter[str] = Counter()
    keys: list[str] = []
    for spec in specs:
        if counts[spec.name] == 1:
            keys.append(spec.name)
        else:
            keys.append(f"{spec.name}#{seen[spec.name]}")
            seen[spec.name] += 1
    return keys


class CombinedReward:
    """Scores completions with several weighted rewards, isolating each call.

    Args:
        specs: the reward terms; at least one.
        timeout_s: deadline of one call (one reward on one completion), in seconds.
        isolation: ``"thread"`` (cheap; a timed-out call's thread is abandoned, not killed) or
            ``"process"`` (a child process killed on timeout; survives hangs and interpreter crashes).
            See ``visionrl.rewards.isolation`` for the trade-off.
        max_workers: threads per batch in thread isolation.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        *,
        timeout_s: float = 10.0,
        isolation: Isolation = "thread",
        max_workers: int = 4,
    ) -> None:
        if not specs:
            raise ValueError("no rewards given; list at least one reward spec (e.g. name: exact_match)")
        if not (isinstance(timeout_s, int | float) and 0 < timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers must be an integer >= 1, got {max_workers!r}")
        self.specs: tuple[RewardSpec, ...] = tuple(specs)
        self.keys: tuple[str, ...] = tuple(component_keys(self.specs))
        self.timeout_s = float(timeout_s)
        self.isolation: Isolation = isolation
        self.max_workers = max_workers
        # Resolve now so a bad spec fails at startup, in the process that reads the config.
        self._fns: list[RewardFn] | None = [resolve_reward(spec) for spec in self.specs]
        self._runner: ThreadRunner | ProcessRunner | None = None

    def __getstate__(self) -> dict[str, Any]:
        # User functions may be unpicklable (closures, lambdas) and runners hold threads or a process:
        # ship the specs and rebuild on the other side.
        state = self.__dict__.copy()
        state["_fns"] = None
        state["_runner"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _get_runner(self) -> ThreadRunner | ProcessRunner:
        if self._runner is None:
            if self.isolation == "process":
                self._runner = ProcessRunner(self.specs, self.timeout_s)
            else:
                if self._fns is None:
                    self._fns = [resolve_reward(spec) for spec in self.specs]
                self._runner = ThreadRunner(self._fns, self.timeout_s, self.max_workers)
        return self._runner

    def score(self, completions: Sequence[str], records: Sequence[Mapping[str, Any]]) -> RewardResult:
        """Scores ``completions[i]`` against ``records[i]`` (its ``"answer"`` and other fields).

        Raises:
            ValueError: the two lists differ in length, or a record is not a mapping (caller bugs).
        """
        if len(completions) != len(records):
            raise ValueError(
                f"got {len(completions)} completions but {len(records)} records; pass one record per completion"
            )
        for index, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise ValueError(f"record {index} is a {type(record).__name__}, expected a dict")
        num_samples = len(completions)
        pairs = [(reward, sample) for sample in range(num_samples) for reward in range(len(self.specs))]
        outcomes = self._get_runner().run(completions, records, pairs) if pairs else []
        return self._collect(num_samples, pairs, outcomes)

    def _collect(
        self, num_samples: int, pairs: Sequence[tuple[int, int]], outcomes: Sequence[Outcome]
    ) -> RewardResult:
        per_reward = {key: [0.0] * num_samples for key in self.keys}
        num_errors = dict.fromkeys(self.keys, 0)
        num_timeouts = dict.fromkeys(self.keys, 0)
        error_examples: dict[str, str] = {}
        total = [0.0] * num_samples
        for (reward, sample), outcome in zip(pairs, outcomes, strict=True):
            key = self.keys[reward]
            per_reward[key][sample] = outcome.value
            total[sample] += self.specs[reward].weight * outcome.value
            if outcome.status == "error":
                num_errors[key] += 1
            elif outcome.status == "timeout":
                num_timeouts[key] += 1
            if outcome.status != "ok":
                error_examples.setdefault(key, outcome.message)
        return RewardResult(total, per_reward, num_errors, num_timeouts, error_examples)

    def close(self) -> None:
        """Releases the worker process, if any. The object stays usable (it restarts lazily)."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None

    def __enter__(self) -> CombinedReward:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def build_reward_fn(
    specs: Sequence[RewardSpec],
    timeout_s: float = 10.0,
    *,
    isolation: Isolation = "thread",
    max_workers: int = 4,
) -> CombinedReward:
    """Builds the combined reward of ``specs``; raises ``RewardConfigError`` for a bad spec (see ``CombinedReward``)."""
    return CombinedReward(specs, timeout_s=timeout_s, isolation=isolation, max_workers=max_workers)
