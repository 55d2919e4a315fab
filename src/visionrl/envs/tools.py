"""The `tools` environment: Python functions the model calls in the Qwen chat template's tool-call format.

The model writes `<tool_call>{"name": "crop", "arguments": {"x1": 0, ...}}</tool_call>` (one or more in a turn);
each call runs and its result (text, an image, or a list of both) comes back as the next turn, a tool message.
A turn without a tool call is the final answer: the episode ends and the job's rewards score it. A call that does
not parse, names no tool, or raises is answered with the error as text (the model can recover) and counted in
the episode's info. A tool function that takes a parameter named `episode` also gets {"record", "images"} (the
record and every image of the episode so far), e.g. to crop the picture the question is about."""

from __future__ import annotations

import importlib
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from PIL import Image

from visionrl.envs.base import Env, Observation, StepResult

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
EPISODE_PARAM = "episode"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def import_function(path: str) -> Callable[..., Any]:
    """`package.module:function` imported (ValueError naming what is missing)."""
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{path}: module {module_name!r} does not import ({err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{path}: {module_name} has no function {name!r}")
    return fn


def tool_schema(name: str, fn: Callable[..., Any], description: str | None = None) -> dict[str, Any]:
    """The JSON schema a chat template lists a tool with: its name, description and typed parameters."""
    properties: dict[str, Any] = {}
    required = []
    for param in inspect.signature(fn).parameters.values():
        if param.name == EPISODE_PARAM or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(param.annotation if isinstance(param.annotation, type) else str, "string")
        if isinstance(param.annotation, str):  # postponed annotations: "int", "float"
            kind = {"int": "integer", "float": "number", "bool": "boolean"}.get(param.annotation, "string")
        properties[param.name] = {"type": kind}
        if param.default is param.empty:
            required.append(param.name)
    text = description or inspect.getdoc(fn) or name
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": text.strip().splitlines()[0],
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def parse_tool_calls(text: str) -> list[tuple[str, dict[str, Any]] | str]:
    """Each `<tool_call>` of `text`: (name, arguments), or the reason it could not be read (a str)."""
    calls: list[tuple[str, dict[str, Any]] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as err:
            calls.append(f"the tool call is not JSON ({err.msg})")
            continue
        call = _stripped(call)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('a tool call needs {"name": ..., "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            calls.append(f"the arguments of {call['name']} must be an object")
            continue
        calls.append((call["name"].strip(), _stripped(arguments)))
    return calls


def _stripped(value: Any) -> Any:
    """Keys and strings without surrounding spaces: a word-level tokenizer decodes `{"x1": 1}` as `{" x1 ": 1}`."""
    if isinstance(value, dict):
        return {str(k).strip(): _stripped(v) for k, v in value.items()}
    return value.strip() if isinstance(value, str) else value


class ToolEnv(Env):
    """Tools called by name; the record's question and images are the first turn."""

    def __init__(self, tools: dict[str, Callable[..., Any]]) -> None:
        self.tools = tools
        self.record: dict[str, Any] = {}
        self.images: list[Image.Image] = []

    def reset(self, record: dict[str, Any]) -> Observation:
        self.record = record
        self.images = list(record.get("images") or [])
        return Observation(text=str(record.get("prompt", "")), images=list(self.images))

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action)
        if not calls:  # no tool call: the final answer
            return StepResult(observation=None, done=True, info={"tool_calls": 0})
        texts: list[str] = []
        images: list[Image.Image] = []
        errors = 0
        for call in calls:
            if isinstance(call, str):
                texts.append(f"error: {call}")
                errors += 1
                continue
            try:
                result = self._call(*call)
            except Exception as err:  # the model's call went wrong: it is told, and can try again
                texts.append(f"error: {call[0]}: {type(err).__name__}: {err}")
                errors += 1
                continue
            for part in result if isinstance(result, list | tuple) else [result]:
                if isinstance(part, Image.Image):
                    images.append(part)
                else:
                    texts.append(str(part))
        self.images += images
        info = {"tool_calls": len(calls), "tool_errors": errors}
        return StepResult(Observation("\n".join(texts), images, role="tool"), info=info)

    def _call(self, name: str, arguments: dict[str, Any]) -> Any:
        fn = self.tools.get(name)
        if fn is None:
            raise LookupError(f"no tool named {name!r}; the tools are {', '.join(sorted(self.tools))}")
        if EPISODE_PARAM in inspect.signature(fn).parameters:
            arguments = {**arguments, EPISODE_PARAM: {"record": self.record, "images": list(self.images)}}
        return fn(**arguments)
