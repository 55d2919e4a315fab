"""Environments the tests run episodes with (imported by the env workers as tests.envs.sample_envs:Name)."""

from __future__ import annotations

import threading
import time
from typing import Any

from PIL import Image

from visionrl.envs import Env, Observation, StepResult


class RetryColour(Env):
    """Name the picture's colour: right at once scores 1; wrong, the picture comes back (an image observation) with
    "look again", and a right second try scores 0.5."""

    def reset(self, record: dict[str, Any]) -> Observation:
        self.answer, self.picture, self.tries = str(record["answer"]), record["images"][0], 0
        return Observation(record["prompt"], [self.picture])

    def step(self, action: str) -> StepResult:
        self.tries += 1
        words = action.strip().split()
        if words and words[0] == self.answer:
            return StepResult(None, reward=1.0 / self.tries, done=True)
        return StepResult(Observation("look again", [self.picture.copy()]), info={"wrong": 1})


class Failing(RetryColour):
    """Raises on the step of records whose answer is `red`; sleeps past any deadline on `blue`."""

    def step(self, action: str) -> StepResult:
        if self.answer == "red":
            raise RuntimeError("the environment broke")
        if self.answer == "blue":
            time.sleep(30)
        return super().step(action)


class Solid(Env):
    """Shows a 32x32 picture of the record's colour each turn: `turns` observations, never done."""

    def __init__(self, size: int = 32) -> None:
        self.size = size

    def reset(self, record: dict[str, Any]) -> Observation:
        return Observation(record["prompt"], record["images"][:1])

    def step(self, action: str) -> StepResult:
        return StepResult(Observation("and this?", [Image.new("RGB", (self.size, self.size), (0, 200, 0))]))


EVENTS: list[tuple[str, str, int]] = []  # ("submit" | "answered", the record's name, turn), as they happened
GATE = threading.Event()  # opened by the test's engine; `Gated` waits for it on slow records
GATE_WAIT_S = {"s": 5.0}


class Gated(RetryColour):
    """RetryColour whose step on records marked `slow` waits for GATE (at most GATE_WAIT_S), then logs its answer."""

    def reset(self, record: dict[str, Any]) -> Observation:
        self.name, self.slow = str(record["name"]), bool(record.get("slow"))
        return super().reset(record)

    def step(self, action: str) -> StepResult:
        if self.slow:
            GATE.wait(GATE_WAIT_S["s"])
            EVENTS.append(("answered", self.name, self.tries + 1))
        return super().step(action)


class ToolRetry(RetryColour):
    """RetryColour whose second look comes back as a tool's answer (role `tool`: a tool response in the template)."""

    def step(self, action: str) -> StepResult:
        result = super().step(action)
        if result.observation is not None:
            result.observation.role = "tool"
        return result
