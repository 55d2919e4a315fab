"""The environment interface: `Env`, what it shows (`Observation`) and what a step returns (`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image


@dataclass
class Observation:
    """What the environment shows the model: text and images, as a user turn (or a tool's answer: `role="tool"`,
    rendered by the chat template as a tool response)."""

    text: str = ""
    images: list[Image.Image] = field(default_factory=list)
    role: Literal["user", "tool"] = "user"


@dataclass
class StepResult:
    """The environment's answer to one turn: the next observation (None when done), the turn's reward, whether
    the episode is over, and anything to report (`info`, kept with the episode)."""

    observation: Observation | None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Env:
    """One episode's environment. Subclass it and implement `reset` and `step`; `close` is called once the
    episode is over (also when it ended by an error or a deadline)."""

    def reset(self, record: dict[str, Any]) -> Observation:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the episode held (nothing by default)."""
