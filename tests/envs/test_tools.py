"""The `tools` environment: Qwen's tool-call format parsed, tools called with their arguments (and the episode's
images when asked), errors answered as text; the calculator evaluates arithmetic and nothing else."""

from __future__ import annotations

import pytest
from PIL import Image

from visionrl.envs.calculator import calculator
from visionrl.envs.tools import ToolEnv, parse_tool_calls, tool_schema
from visionrl.envs.zoom import crop


def test_tool_calls_are_read_in_qwen_format() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "crop", "arguments": {"x1": 0, "y1": 10}}\n</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+2\\"}"}</tool_call>'
        "<tool_call>{name: crop}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ("crop", {"x1": 0, "y1": 10})
    assert calls[1] == ("calculator", {"expression": "1+2"})  # arguments written as a JSON string
    assert isinstance(calls[2], str) and calls[2].startswith("the tool call is not JSON")
    assert calls[3] == 'a tool call needs {"name": ..., "arguments": {...}}'
    assert parse_tool_calls("the answer is 4") == []


def test_a_tool_schema_comes_from_the_function_signature() -> None:
    schema = tool_schema("crop", crop)
    function = schema["function"]
    assert function["name"] == "crop" and function["description"].startswith("Crop the picture")
    params = function["parameters"]
    assert params["properties"] == {name: {"type": "integer"} for name in ("x1", "y1", "x2", "y2")}
    assert params["required"] == ["x1", "y1", "x2", "y2"]  # `episode` is visionrl's, not the model's


def _env() -> ToolEnv:
    def add(a: int, b: int) -> str:
        return str(a + b)

    def broken() -> str:
        raise OSError("disk gone")

    env = ToolEnv({"add": add, "broken": broken, "crop": crop, "calculator": calculator})
    picture = Image.new("RGB", (200, 100), (0, 0, 255))
    picture.paste((255, 0, 0), (100, 50, 200, 100))  # the bottom-right quarter is red
    obs = env.reset({"prompt": "what is in the corner?", "images": [picture]})
    assert obs.text == "what is in the corner?" and obs.images == [picture] and obs.role == "user"
    return env


def test_a_turn_with_a_call_gets_the_tools_answer_and_one_without_ends_the_episode() -> None:
    env = _env()
    result = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert result.observation is not None and result.observation.role == "tool"
    assert (
        result.observation.text == "5"
        and not result.done
        and result.info == {"tool_calls": 1, "tool_errors": 0}
    )
    # crop gets the episode's picture: the bottom-right quarter comes back red, at the picture's own pixels
    result = env.step(
        '<tool_call>{"name": "crop", "arguments": {"x1": 500, "y1": 500, "x2": 1000, "y2": 1000}}</tool_call>'
    )
    assert result.observation is not None and len(result.observation.images) == 1
    region = result.observation.images[0]
    assert region.size == (100, 50) and region.getpixel((50, 25)) == (255, 0, 0)
    final = env.step("red")
    assert final.done and final.observation is None and final.reward == 0.0


def test_a_wrong_call_is_answered_with_the_error_and_counted() -> None:
    env = _env()
    result = env.step(
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{"name": "broken", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": "crop", "arguments": '
        '{"x1": 900, "y1": 0, "x2": 100, "y2": 10}}</tool_call>'
    )
    assert result.observation is not None and not result.done
    lines = result.observation.text.splitlines()
    assert (
        lines[0]
        == "error: nope: LookupError: no tool named 'nope'; the tools are add, broken, calculator, crop"
    )
    assert lines[1] == "error: broken: OSError: disk gone"
    assert lines[2].startswith("error: add: TypeError:") and "'b'" in lines[2]
    assert lines[3] == "error: crop: ValueError: x2 must exceed x1 and y2 must exceed y1"
    assert result.info == {"tool_calls": 4, "tool_errors": 4}


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("(3 + 4) * 2.5", "17.5"),
        ("2 ** 10", "1024"),
        ("7 // 2 + 7 % 2", "4"),
        ("-1.5 * 4", "-6"),
        ("1 / 3", str(1 / 3)),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os')", "only numbers and"),
        ("x + 1", "only numbers and"),
        ("9 ** 9 ** 9", "exponents above 100 are refused"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than 200"),
        ("True + 1", "only numbers and"),
    ],
)
def test_the_calculator_refuses_anything_else(expression: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        calculator(expression)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")
