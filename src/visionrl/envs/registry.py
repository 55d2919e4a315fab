"""From the job file's `env` section to an environment object per episode, and the tools its chat template lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from visionrl.envs.base import Env
from visionrl.envs.calculator import calculator
from visionrl.envs.tools import ToolEnv, import_function, tool_schema


def _tools(env: Any) -> list[tuple[str, Callable[..., Any], str | None]]:
    """(name, function, description) of every tool the environment `env` (an EnvConfig) offers."""
    tools = [(t.name, import_function(t.function), t.description) for t in env.tools]
    if env.name == "calculator":
        tools.append(("calculator", calculator, None))
    if env.name == "zoom":
        from visionrl.envs.zoom import crop

        tools.append(("crop", crop, None))
    return tools


def tool_schemas(env: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template lists in the system turn (None: the environment offers none)."""
    schemas = [tool_schema(name, fn, text) for name, fn, text in _tools(env)]
    return schemas or None


def env_factory(env: Any) -> Callable[[], Env]:
    """A function that makes one episode's environment (checked once here: a bad name fails at start)."""
    if env.name == "zoom":
        from visionrl.envs.zoom import ZoomEnv

        return lambda: ZoomEnv(**env.kwargs)
    if env.name in ("tools", "calculator"):
        tools = {name: fn for name, fn, _ in _tools(env)}
        if not tools:
            raise ValueError("env: the tools environment needs env.tools (name and package.module:function)")
        return lambda: ToolEnv(tools, **env.kwargs)
    if env.name == "maze":
        from visionrl.envs.maze import MazeEnv

        return lambda: MazeEnv(**env.kwargs)
    cls = import_function(env.name)
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"env.name {env.name}: not a visionrl.envs.Env subclass")
    return lambda: cls(**env.kwargs)


def check_env(env: Any) -> None:
    """An environment that cannot be made (a module that does not import, a class that is no Env, kwargs its
    constructor refuses) as an InputError naming the key, before anything starts."""
    from visionrl.errors import InputError

    try:
        env_factory(env)()
    except (ValueError, TypeError) as err:
        raise InputError(f"env: {err}; check env.name, env.kwargs and env.tools") from None
