"""The `env:` section of a job: multi-turn episodes (`visionrl.envs`): which environment, its arguments, the turn
and image limits, the deadline of each environment call, and the tools of the `tools` environment."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from visionrl.config_yaml import Section

BUILTIN_ENVS = ("tools", "calculator", "zoom", "maze")


class ToolConfig(Section):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="The name the model calls."
    )
    function: str = Field(
        description="The Python function: package.module:function (text or images in, text or images out)."
    )
    description: str | None = Field(
        None, description="What the model is told it does; default: the docstring."
    )

    @field_validator("function")
    @classmethod
    def validate_function(cls, value: str) -> str:
        module, _, name = value.partition(":")
        if not module or not name:
            raise ValueError(f"{value!r}: write a tool's function as package.module:function")
        return value


class EnvConfig(Section):
    name: str = Field(
        description=f"A built-in environment ({', '.join(BUILTIN_ENVS)}) or your own: package.module:Class "
        "(a visionrl.envs.Env)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the environment's constructor."
    )
    max_turns: int = Field(4, ge=1, le=64, description="Model turns per episode (the last one ends it).")
    max_images: int = Field(
        8,
        ge=1,
        le=256,
        description="Images per episode, the prompt's and the observations' (each within the "
        "data.min_pixels/max_pixels budget); an episode that would pass it ends, counted.",
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Deadline of each reset/step call; past it the episode ends with reward 0.",
    )
    num_workers: int = Field(1, ge=1, le=1024, description="Ray actors that run the environments.")
    pipeline: Literal["turns", "continuous"] = Field(
        "turns",
        description="continuous: an episode's next turn joins the engine's running batch as soon as its "
        "environment answers, so environment time overlaps generation (the engine is seeded once a step, and a "
        "sampled turn's noise depends on when it joins: greedy episodes repeat exactly, sampled ones do not); "
        "turns: every live episode of an engine generates its turn (seeded per turn), then all their "
        "environments step. Continuous was 19-21% faster with environments of uneven step times and 3-42% "
        "slower with equal ones on the CPU (benchmarks/NOTES-zoom.md).",
    )
    tools: list[ToolConfig] = Field(
        default_factory=list,
        description="Tools of the `tools` environment (calculator and zoom bring their own).",
    )

    @field_validator("name")
    @classmethod
    def validate_name(cls, value: str) -> str:
        if value not in BUILTIN_ENVS and ":" not in value:
            raise ValueError(
                f"{value!r} is neither a built-in environment ({', '.join(BUILTIN_ENVS)}) nor package.module:Class"
            )
        return value

    @field_validator("tools")
    @classmethod
    def validate_tools(cls, tools: list[ToolConfig]) -> list[ToolConfig]:
        names = [t.name for t in tools]
        if len(set(names)) < len(names):
            raise ValueError(f"env.tools names a tool twice: {names}")
        return tools
