"""Tests of the built-in rewards (visionrl.rewards.builtin) and their text parsing helpers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from visionrl.rewards import choice, exact_match, format_reward, iou, list_builtin_rewards, numeric
from visionrl.rewards.parsing import extract_answer, last_number, normalize_text

RECORD: dict[str, Any] = {"id": "r0", "answer": None}
COLOURS = ["red", "green", "blue", "yellow"]  # letters A B C D: C is blue
MC_RECORD: dict[str, Any] = {"id": "mc", "metadata": {"choices": COLOURS}}


def test_builtin_names() -> None:
    assert list_builtin_rewards() == ["choice", "exact_match", "format", "iou", "numeric"]


# ---------------------------------------------------------------- parsing helpers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  Blue.  ", "blue"),
        ('"Blue."', "blue"),  # trailing dot inside the quotes, then the quotes
        ("\u201cBlue\u201d!", "blue"),  # curly quotes and "!"
        ("**blue**", "blue"),
        ("Light \n\t Blue", "light blue"),
        ("3.5", "3.5"),  # an inner dot is content
        ("...", ""),
    ],
)
def test_normalize_text(text: str, expected: str) -> None:
    assert normalize_text(text) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>maybe red</think><answer> blue </answer>", " blue "),
        ("<answer>red</answer> then <answer>blue</answer>", "blue"),  # the last one counts
        ("<ANSWER>blue</Answer>", "blue"),  # tag case is lenient here
        ("<think>hmm</think><answer>blu", "blu"),  # cut by the token limit
        ("<think>red</think>blue", " blue"),  # reasoning removed
        ("plain", "plain"),
    ],
)
def test_extract_answer(completion: str, expected: str) -> None:
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 3/4.", 0.75),
        ("1,000 apples", 1000.0),
        ("12,345.5", 12345.5),
        ("3 + 4 = 7", 7.0),  # last number
        ("x = -3", -3.0),
        ("x = \u22125", -5.0),  # unicode minus
        ("3-5", 5.0),  # a range: the dash is not a sign
        (".5", 0.5),
        ("1e3", 1000.0),
        ("1, 2, 3", 3.0),
        ("3 / 4", 0.75),
        ("1/0", None),  # division by zero is not a number
        ("seven", 7.0),
        ("Twenty!", 20.0),
        ("2 apples and one pear", 2.0),  # words only when no digits appear
        ("none here", None),
        ("", None),
    ],
)
def test_last_number(text: str, expected: float | None) -> None:
    assert last_number(text) == expected


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("completion", "answer", "kwargs", "expected"),
    [
        ("Blue", "blue", {}, 1.0),
        ("  blue.  ", "Blue", {}, 1.0),
        ('"Blue"', "blue", {}, 1.0),
        ("**blue**!", "blue", {}, 1.0),
        ("light   blue", "Light Blue", {}, 1.0),
        ("blue sky", "blue", {}, 0.0),
        ("bluer", "blue", {}, 0.0),
        ("", "blue", {}, 0.0),
        ("blue sky", "blue", {"first_word": True}, 1.0),
        ("Blue, clearly.", "blue", {"first_word": True}, 1.0),
        ("It is blue", "blue", {"first_word": True}, 0.0),
        ("light blue square", "light blue", {"first_word": True}, 1.0),  # two words for a two-word answer
        ("light green square", "light blue", {"first_word": True}, 0.0),
        ("", "blue", {"first_word": True}, 0.0),
        ("<think>red?</think><answer>Blue</answer>", "blue", {}, 1.0),
        ("<think>blue</think> red", "blue", {}, 0.0),  # reasoning does not count
        ("<answer>red</answer> blue", "blue", {}, 0.0),  # the tag wins over trailing text
        ("<answer>blue", "blue", {}, 1.0),
        ("42", 42, {}, 1.0),
        ("grey", ["gray", "grey"], {}, 1.0),  # several acceptable answers
        ("green", ["gray", "grey"], {}, 0.0),
    ],
)
def test_exact_match(completion: str, answer: Any, kwargs: dict[str, Any], expected: float) -> None:
    assert exact_match(completion, answer, RECORD, **kwargs) == expected


@pytest.mark.parametrize("answer", [None, "", " . ", [], {"a": 1}, True, ["blue", None]])
def test_exact_match_bad_reference_raises(answer: Any) -> None:
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("blue", answer, RECORD)


# ---------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("C", 1.0),
        ("c", 1.0),
        ("(C)", 1.0),
        ("C.", 1.0),
        ("Answer: C", 1.0),
        ("The answer is (C).", 1.0),
        ("C. blue", 1.0),
        ("I pick (C) because it is cold.", 1.0),
        ("blue", 1.0),
        ("Blue.", 1.0),
        ("The shape is blue.", 1.0),
        ("A blue square", 1.0),  # the article "A" is not option A
        ("<think>A or C?</think><answer>C</answer>", 1.0),
        ("B", 0.0),
        ("(B) blue", 0.0),  # a letter, when given, decides
        ("Answer: B, blue", 0.0),
        ("red or blue", 0.0),  # two options named: hedging
        ("A red square", 0.0),
        ("bluegreen", 0.0),  # whole words only
        ("purple", 0.0),
        ("", 0.0),
    ],
)
@pytest.mark.parametrize("answer", ["C", "(c)", "blue", "Blue."])
def test_choice_with_choices(completion: str, answer: str, expected: float) -> None:
    assert choice(completion, answer, MC_RECORD) == expected


def test_choice_top_level_choices_field() -> None:
    record = {"id": "x", "choices": ["cat", "dog"]}
    assert choice("B", "dog", record) == 1.0
    assert choice("a dog", "B", record) == 1.0
    assert choice("A", "dog", record) == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("B", "B", 1.0),
        ("(B)", "b", 1.0),
        ("blue", "B", 0.0),  # without choices the text of option B is unknown
        ("blue", "blue", 1.0),
        ("B", "blue", 0.0),  # without choices the letter of "blue" is unknown
    ],
)
def test_choice_without_choices(completion: str, answer: str, expected: float) -> None:
    assert choice(completion, answer, {"id": "x"}) == expected


@pytest.mark.parametrize(
    ("answer", "record", "message"),
    [
        ("purple", MC_RECORD, "neither an option letter"),
        ("E", MC_RECORD, "neither an option letter"),  # only 4 options
        (None, MC_RECORD, "reference answer"),
        ("", MC_RECORD, "empty"),
        ("A", {"choices": "red,blue"}, "list of option texts"),
        ("A", {"choices": []}, "1 to 26"),
    ],
)
def test_choice_bad_reference_raises(answer: Any, record: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choice("A", answer, record)


# ---------------------------------------------------------------- numeric


@pytest.mark.parametrize(
    ("completion", "answer", "kwargs", "expected"),
    [
        ("The answer is 3/4.", 0.75, {}, 1.0),
        ("1,000", 1000, {}, 1.0),
        ("3.5", 3, {}, 0.0),
        ("0.75", "3/4", {}, 1.0),
        ("3", "3/4", {}, 0.0),
        ("-2", -2, {}, 1.0),
        ("2", -2, {}, 0.0),
        ("3 + 4 = 7", 7, {}, 1.0),
        ("3 + 4 = 7", 3, {}, 0.0),
        ("<answer>12</answer> and 5 more", "12", {}, 1.0),
        ("There are seven.", 7, {}, 1.0),
        ("There are seven.", 7, {"number_words": False}, 0.0),
        ("no number here", 0, {}, 0.0),
        ("1/0", 0, {}, 0.0),
        ("1e3", "1,000", {}, 1.0),
        # 1/3 = 0.333333...: |0.3333 - 1/3| = 3.3e-5 > 1e-6 (default) but <= 1e-3.
        ("0.3333", "1/3", {}, 0.0),
        ("0.3333", "1/3", {"abs_tol": 1e-3}, 1.0),
        # rel_tol 0.02: |101 - 100| = 1 <= 0.02 * 101 = 2.02 -> 1; |103 - 100| = 3 > 0.02 * 103 = 2.06 -> 0.
        ("101", 100, {"rel_tol": 0.02, "abs_tol": 0.0}, 1.0),
        ("103", 100, {"rel_tol": 0.02, "abs_tol": 0.0}, 0.0),
        ("1.0000005", 1, {}, 1.0),  # within the default abs_tol 1e-6
        ("1.000002", 1, {}, 0.0),
    ],
)
def test_numeric(completion: str, answer: Any, kwargs: dict[str, Any], expected: float) -> None:
    assert numeric(completion, answer, RECORD, **kwargs) == expected


@pytest.mark.parametrize(
    "answer", ["abc", "", "1/0", "3 apples", True, None, float("nan"), float("inf"), [1]]
)
def test_numeric_bad_reference_raises(answer: Any) -> None:
    with pytest.raises(ValueError, match="reference answer"):
        numeric("3", answer, RECORD)


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>b</answer>", 1.0),
        ("  <think>\nreason\n</think>\n\n<answer> 42 </answer>\n", 1.0),
        ("<think></think><answer>x</answer>", 1.0),  # empty reasoning is allowed
        ("<think>a</think><answer> </answer>", 0.0),  # empty answer is not
        ("<answer>b</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("<think>a</think><answer>b</answer> trailing", 0.0),
        ("prefix <think>a</think><answer>b</answer>", 0.0),
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
        ("<think>a<think>b</think><answer>c</answer>", 0.0),
        ("<answer>b</answer><think>a</think>", 0.0),
        ("<THINK>a</THINK><ANSWER>b</ANSWER>", 0.0),
        ("<think>a</think><answer>b", 0.0),
        ("", 0.0),
    ],
)
def test_format(completion: str, expected: float) -> None:
    assert format_reward(completion, "anything", RECORD) == expected


# ---------------------------------------------------------------- iou


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        # [0,0,10,10] vs [5,0,15,10]: intersection 5 x 10 = 50; union 100 + 100 - 50 = 150 -> 1/3.
        ("[0, 0, 10, 10]", [5, 0, 15, 10], 1 / 3),
        ("[5,0,15,10]", [5, 0, 15, 10], 1.0),
        # (0,0),(10,10) vs [0,0,10,20]: intersection 100; union 100 + 200 - 100 = 200 -> 0.5.
        ("The box is (0,0),(10,10).", [0, 0, 10, 20], 0.5),
        ("(0, 0, 10, 10)", [0, 0, 10, 20], 0.5),
        ("[[0, 0], [10, 10]]", [0, 0, 10, 20], 0.5),
        ('{"bbox_2d": [5, 0, 15, 10], "label": "cat"}', [0, 0, 10, 10], 1 / 3),
        # [0,0,.5,.5] vs [0,0,1,1]: intersection 0.25; union 1 + 0.25 - 0.25 = 1 -> 0.25.
        ("[0.0, 0.0, 0.5, 0.5]", [0, 0, 1, 1], 0.25),
        ("[20, 20, 30, 30]", [0, 0, 10, 10], 0.0),  # disjoint
        ("[10, 0, 20, 10]", [0, 0, 10, 10], 0.0),  # touching edge: zero-area intersection
        # best reference: [100,100,110,120] vs [100,100,110,110] -> 100 / (200 + 100 - 100) = 0.5.
        ("[100, 100, 110, 120]", [[0, 0, 10, 10], [100, 100, 110, 110]], 0.5),
        ("[0,0,10,10] or maybe [5,0,15,10]", [5, 0, 15, 10], 1 / 3),  # the first box counts
        ("<think>[5,0,15,10]?</think><answer>[0,0,10,10]</answer>", [5, 0, 15, 10], 1 / 3),
        ("[10, 10, 0, 0]", [0, 0, 10, 10], 0.0),  # inverted prediction has no area
        ("about the middle", [0, 0, 10, 10], 0.0),
        ("[1, 2, 3]", [0, 0, 10, 10], 0.0),
        ("[0, 0, 10, 10]", "[5, 0, 15, 10]", 1 / 3),  # reference given as text
        ("[0, 0, 10, 10]", (5, 0, 15, 10), 1 / 3),
    ],
)
def test_iou(completion: str, answer: Any, expected: float) -> None:
    assert iou(completion, answer, RECORD) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("completion", "threshold", "expected"),
    [
        ("[0, 0, 10, 10]", 0.5, 0.0),  # IoU 1/3 < 0.5
        ("[0, 0, 10, 10]", 0.3, 1.0),  # IoU 1/3 >= 0.3
        ("[5, 0, 15, 10]", 1.0, 1.0),  # exact box reaches threshold 1
        ("no box", 0.1, 0.0),
    ],
)
def test_iou_threshold(completion: str, threshold: float, expected: float) -> None:
    assert iou(completion, [5, 0, 15, 10], RECORD, threshold=threshold) == expected


def test_iou_threshold_is_inclusive() -> None:
    # IoU exactly 0.5 (see test_iou) passes a 0.5 threshold.
    assert iou("(0,0),(10,10)", [0, 0, 10, 20], RECORD, threshold=0.5) == 1.0


@pytest.mark.parametrize(
    "answer",
    [
        [10, 0, 5, 10],
        [0, 0, 0, 10],
        [1, 2, 3],
        "no box",
        [[0, 0, 1, 1], [0, 0]],
        None,
        [0, 0, "a", 1],
        [],
        [0, 0, True, 1],
    ],
)
def test_iou_bad_reference_raises(answer: Any) -> None:
    with pytest.raises(ValueError, match="reference|answer"):
        iou("[0, 0, 1, 1]", answer, RECORD)


# ---------------------------------------------------------------- never raise on completions

_VALID_ANSWERS: list[tuple[Any, Any, dict[str, Any]]] = [
    (exact_match, "blue", {}),
    (exact_match, "light blue", {"first_word": True}),
    (choice, "C", MC_RECORD),
    (numeric, "3/4", {}),
    (format_reward, None, {}),
    (iou, [0, 0, 10, 10], {}),
]
# Fragments that exercise the regexes harder than uniform unicode text does.
_FRAGMENTS = list("<>/()[],.:-+ 0123456789eEABCabc\n*\"'") + ["<answer>", "</answer>", "<think>", "</think>"]
_TRICKY = st.lists(st.sampled_from(_FRAGMENTS), max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(completion=st.one_of(st.text(), _TRICKY))
def test_builtins_never_raise_on_completions(completion: str) -> None:
    for fn, answer, record in _VALID_ANSWERS:
        value = fn(completion, answer, record)
        assert isinstance(value, float)
        assert 0.0 <= value <= 1.0
