"""The stepping API (`types.SteppingEngine`) in its simple form, over any engine's `generate`: what is submitted
waits in a queue, and `collect` generates the whole queue as one batch. The HF engine steps this way (transformers'
`generate` takes no request once a batch runs); vLLM's engine has its own running batch (`rollout.vllm_stepping`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from visionrl.types import Completion, PromptItem, SamplingSpec


@dataclass
class Queued:
    rid: str
    prompt: PromptItem
    spec: SamplingSpec


def check_spec(spec: SamplingSpec) -> None:
    if spec.n != 1:
        raise ValueError(
            f"a stepping engine takes one completion per request (SamplingSpec.n=1), not {spec.n}"
        )


class BatchingStepper:
    """Submitted prompts queued; `collect` runs `generate` on the queue (one call per sampling spec, in order)."""

    def __init__(self, generate: Callable[[list[PromptItem], SamplingSpec], list[list[Completion]]]) -> None:
        self._generate = generate
        self._queue: list[Queued] = []
        self._ids = itertools.count(1)

    def busy(self) -> bool:
        return bool(self._queue)

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        check_spec(spec)
        if spec.seed is not None and self._queue:
            raise RuntimeError("a seeded submit while requests are in flight: only a lane's first turns seed")
        queued = [Queued(f"hf-{next(self._ids)}", p, spec) for p in prompts]
        self._queue += queued
        return [q.rid for q in queued]

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        """Everything queued, generated now (the wait is the batch's own time, whatever `timeout_s` says)."""
        batch, self._queue = self._queue, []
        done: dict[str, list[Completion]] = {}
        while batch:
            spec = batch[0].spec
            same = [q for q in batch if q.spec == spec]
            batch = [q for q in batch if q.spec != spec]
            groups = self._generate([q.prompt for q in same], spec)
            done.update((q.rid, group) for q, group in zip(same, groups, strict=True))
        return done

    def abort(self) -> int:
        dropped, self._queue = len(self._queue), []
        return dropped
