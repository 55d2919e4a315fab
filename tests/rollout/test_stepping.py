"""The stepping API in its simple form (`rollout.stepping.BatchingStepper`, the HF engine's): what is queued is
generated as one batch per sampling spec, results come back under the ids `submit` gave, a seed goes only with
the first submission, and abort leaves nothing behind."""

from __future__ import annotations

import pytest

from visionrl.rollout.stepping import BatchingStepper
from visionrl.types import Completion, PromptItem, SamplingSpec


class EchoEngine:
    """Answers each prompt with its own text; remembers every batch it generated (prompts and spec)."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[str], SamplingSpec]] = []

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self.batches.append(([p.text for p in prompts], spec))
        return [[Completion(i, [i], p.text, [-0.5], "stop")] for i, p in enumerate(prompts)]


def _prompts(*texts: str) -> list[PromptItem]:
    return [PromptItem(t, [], None) for t in texts]


def test_the_queue_is_generated_as_one_batch_per_spec_under_the_submitted_ids() -> None:
    engine = EchoEngine()
    stepper = BatchingStepper(engine.generate)
    first = SamplingSpec(n=1, max_tokens=4, seed=9)
    later = SamplingSpec(n=1, max_tokens=4)
    ids = stepper.submit(_prompts("a", "b"), first)
    ids += stepper.submit(_prompts("c"), later)
    assert stepper.busy()
    done = stepper.collect(0.0)
    assert {rid: [c.text for c in group] for rid, group in done.items()} == dict(
        zip(ids, [["a"], ["b"], ["c"]], strict=True)
    )
    assert engine.batches == [(["a", "b"], first), (["c"], later)]
    assert not stepper.busy() and stepper.collect(0.0) == {}  # nothing in flight: at once, nothing
    more = stepper.submit(_prompts("d"), later)
    assert set(more).isdisjoint(ids)  # ids are never reused


def test_a_seed_only_with_nothing_in_flight_and_one_completion_per_request() -> None:
    stepper = BatchingStepper(EchoEngine().generate)
    stepper.submit(_prompts("a"), SamplingSpec(n=1, seed=1))
    with pytest.raises(RuntimeError, match="first turns seed"):
        stepper.submit(_prompts("b"), SamplingSpec(n=1, seed=2))
    with pytest.raises(ValueError, match="SamplingSpec.n=1"):
        stepper.submit(_prompts("c"), SamplingSpec(n=4))
    assert stepper.abort() == 1
    assert not stepper.busy() and stepper.collect(0.0) == {}
