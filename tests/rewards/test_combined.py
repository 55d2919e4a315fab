"""Tests of reward specs, user functions by import path, the weighted combination and call isolation."""

from __future__ import annotations

import pickle
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from visionrl.rewards import (
    CombinedReward,
    RewardConfigError,
    RewardSpec,
    build_reward_fn,
    component_keys,
    resolve_reward,
)

# User reward functions, written to a fresh module per test. Each misbehaves only when its trigger word
# is in the completion, so one batch shows the failure and the healthy calls side by side.
USER_MODULE = textwrap.dedent(
    """
    import os
    import time

    def length_penalty(completion, answer, record, *, per_char=0.01):
        return -per_char * len(completion)

    def uses_record(completion, answer, record):
        return float(record["metadata"]["difficulty"])

    def boom(completion, answer, record):
        if "boom" in completion:
            raise RuntimeError("kaboom")
        return 1.0

    def slow(completion, answer, record):
        if "slow" in completion:
            time.sleep(1.0)
        return 0.5

    def bad_values(completion, answer, record):
        values = {"nan": float("nan"), "none": None, "text": "1.0", "inf": float("inf"), "huge": 1e38, "max": -1e6}
        return values.get(completion, True)

    def exits(completion, answer, record):
        if "exit" in completion:
            raise SystemExit(2)
        return 1.0

    def crash_or_hang(completion, answer, record):
        if "die" in completion:
            os._exit(3)
        if "hang" in completion:
            while True:
                pass
        return 0.25

    quarter = lambda completion, answer, record: 0.25

    class Scorer:
        @staticmethod
        def score(completion, answer, record):
            return 0.75

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Name of an importable module holding USER_MODULE (unique, so no stale sys.modules entry)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _records(answers: list[Any]) -> list[dict[str, Any]]:
    return [
        {"id": str(i), "images": [], "answer": a, "metadata": {"difficulty": 0.5}}
        for i, a in enumerate(answers)
    ]


# ---------------------------------------------------------------- specs and resolution


def test_spec_defaults_and_validation() -> None:
    spec = RewardSpec("exact_match")
    assert (spec.weight, spec.kwargs) == (1.0, {})
    for bad in [
        {"name": ""},
        {"name": "x", "weight": float("nan")},
        {"name": "x", "weight": "2"},
        {"name": "x", "kwargs": [1]},
    ]:
        with pytest.raises(RewardConfigError):
            RewardSpec(**bad)


def test_component_keys_number_duplicates() -> None:
    specs = [
        RewardSpec("exact_match"),
        RewardSpec("format"),
        RewardSpec("exact_match", kwargs={"first_word": True}),
    ]
    assert component_keys(specs) == ["exact_match#0", "format", "exact_match#1"]


@pytest.mark.parametrize(
    ("spec", "fragments"),
    [
        (RewardSpec("exactmatch"), ["unknown reward 'exactmatch'", "exact_match", "package.module:function"]),
        (RewardSpec("a:b:c"), ["not a valid import path"]),
        (RewardSpec(":fn"), ["not a valid import path"]),
        (RewardSpec("no_such_module_vr:fn"), ["importing module 'no_such_module_vr' failed", "PYTHONPATH"]),
        (RewardSpec("numeric", kwargs={"abs_tol": -1}), ["abs_tol must be a finite number >= 0"]),
        (RewardSpec("iou", kwargs={"threshold": 1.5}), ["threshold must be in (0, 1]"]),
        (RewardSpec("exact_match", kwargs={"first_word": "yes"}), ["first_word must be true or false"]),
        (RewardSpec("exact_match", kwargs={"firstword": True}), ["cannot be called", "firstword", "kwargs"]),
    ],
)
def test_bad_spec_messages(spec: RewardSpec, fragments: list[str]) -> None:
    with pytest.raises(RewardConfigError) as info:
        resolve_reward(spec)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_user_attribute_messages(user_module: str) -> None:
    with pytest.raises(RewardConfigError, match="has no attribute 'lenght_penalty'") as info:
        resolve_reward(RewardSpec(f"{user_module}:lenght_penalty"))
    assert "length_penalty" in str(info.value)  # the message lists what the module does define
    with pytest.raises(RewardConfigError, match="is a int, not a function"):
        resolve_reward(RewardSpec(f"{user_module}:NOT_CALLABLE"))
    with pytest.raises(RewardConfigError, match="cannot be called"):
        resolve_reward(RewardSpec(f"{user_module}:length_penalty", kwargs={"per_token": 1}))


def test_user_functions_by_path(user_module: str) -> None:
    assert resolve_reward(RewardSpec(f"{user_module}:Scorer.score"))("x", None, {}) == 0.75
    penalty = resolve_reward(RewardSpec(f"{user_module}:length_penalty", kwargs={"per_char": 0.1}))
    assert penalty("abcd", None, {}) == pytest.approx(-0.4)  # -0.1 * 4 characters


# ---------------------------------------------------------------- combination


def test_weighted_sum_by_hand() -> None:
    reward = build_reward_fn([RewardSpec("exact_match", weight=0.5), RewardSpec("format", weight=2.0)])
    completions = [
        "<think>hmm</think><answer>Blue</answer>",  # exact 1, format 1 -> 0.5 + 2.0 = 2.5
        "blue",  # exact 1, format 0 -> 0.5
        "<think>x</think> <answer>red</answer>",  # exact 0, format 1 -> 2.0
        "red",  # exact 0, format 0 -> 0.0
    ]
    result = reward.score(completions, _records(["blue"] * 4))
    assert result.total == [2.5, 0.5, 2.0, 0.0]
    assert result.per_reward == {"exact_match": [1.0, 1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0, 0.0]}
    assert result.num_errors == {"exact_match": 0, "format": 0}
    assert result.num_timeouts == {"exact_match": 0, "format": 0}
    assert result.error_examples == {}


def test_duplicate_names_and_user_function_with_record(user_module: str) -> None:
    reward = build_reward_fn(
        [
            RewardSpec("exact_match"),
            RewardSpec("exact_match", weight=3.0, kwargs={"first_word": True}),
            RewardSpec(f"{user_module}:uses_record", weight=-1.0),
            RewardSpec(f"{user_module}:length_penalty", kwargs={"per_char": 0.1}),
        ]
    )
    result = reward.score(["blue sky", "blue"], _records(["blue", "red"]))
    # sample 0: whole 0, first word 1 (x3), difficulty 0.5 (x-1), penalty -0.1 * 8 chars -> 3 - 0.5 - 0.8 = 1.7
    # sample 1: whole 0, first word 0, -0.5, -0.1 * 4 chars -> -0.9
    assert result.total == pytest.approx([1.7, -0.9])
    assert result.per_reward["exact_match#0"] == [0.0, 0.0]
    assert result.per_reward["exact_match#1"] == [1.0, 0.0]
    assert result.per_reward[f"{user_module}:length_penalty"] == pytest.approx([-0.8, -0.4])


def test_empty_batch_and_argument_errors() -> None:
    reward = build_reward_fn([RewardSpec("format")])
    empty = reward.score([], [])
    assert (empty.total, empty.per_reward, empty.num_errors) == ([], {"format": []}, {"format": 0})
    with pytest.raises(ValueError, match="2 completions but 1 records"):
        reward.score(["a", "b"], _records(["x"]))
    with pytest.raises(ValueError, match="record 0 is a str"):
        reward.score(["a"], ["x"])  # type: ignore[list-item]
    for kwargs in [{"timeout_s": 0}, {"isolation": "fork"}, {"max_workers": 0}]:
        with pytest.raises(ValueError):
            build_reward_fn([RewardSpec("format")], **kwargs)
    with pytest.raises(ValueError, match="no rewards"):
        build_reward_fn([])


# ---------------------------------------------------------------- isolation (threads)


def test_raising_reward_is_counted_and_others_still_scored(user_module: str) -> None:
    reward = build_reward_fn([RewardSpec("exact_match"), RewardSpec(f"{user_module}:boom", weight=2.0)])
    result = reward.score(["blue", "boom", "boom blue"], _records(["blue", "blue", "boom blue"]))
    assert result.per_reward[f"{user_module}:boom"] == [1.0, 0.0, 0.0]
    assert result.per_reward["exact_match"] == [1.0, 0.0, 1.0]
    assert result.total == [3.0, 0.0, 1.0]  # 1 + 2 * 1; 0 + 0; 1 + 0
    assert result.num_errors == {"exact_match": 0, f"{user_module}:boom": 2}
    assert result.error_examples == {f"{user_module}:boom": "RuntimeError: kaboom"}


def test_builtin_bad_reference_is_counted_with_its_message() -> None:
    result = build_reward_fn([RewardSpec("numeric")]).score(["3", "3"], _records(["three?", "3"]))
    assert result.per_reward["numeric"] == [0.0, 1.0]
    assert result.num_errors == {"numeric": 1}
    assert "three?" in result.error_examples["numeric"]


def test_non_numbers_are_errors(user_module: str) -> None:
    reward = build_reward_fn([RewardSpec(f"{user_module}:bad_values")])
    result = reward.score(["nan", "none", "text", "inf", "ok", "huge", "max"], _records([None] * 7))
    key = f"{user_module}:bad_values"
    assert result.per_reward[key] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, -1e6]  # `True` counts as 1.0
    assert result.num_errors[key] == 5
    assert result.error_examples[key] == "returned float nan; a reward must return a finite number"
    # 1e38 is finite, but overflowed float32 in the advantages and TensorBoard's histograms: counted too
    only_huge = reward.score(["huge"], _records([None]))
    assert only_huge.error_examples[key].startswith(
        "returned 1e+38, outside [-1e+06, 1e+06]; scale the reward down"
    )


def test_sys_exit_in_reward_is_an_error(user_module: str) -> None:
    result = build_reward_fn([RewardSpec(f"{user_module}:exits")]).score(
        ["exit", "fine"], _records([None, None])
    )
    assert result.per_reward[f"{user_module}:exits"] == [0.0, 1.0]
    assert result.error_examples[f"{user_module}:exits"] == "SystemExit: 2"


def test_slow_reward_times_out(user_module: str) -> None:
    key = f"{user_module}:slow"
    # One worker: the two fast calls queued behind the slow one still get their own full deadline.
    reward = build_reward_fn([RewardSpec("exact_match"), RewardSpec(key)], timeout_s=0.2, max_workers=1)
    result = reward.score(["slow", "blue", "red"], _records(["slow", "blue", "blue"]))
    assert result.per_reward[key] == [0.0, 0.5, 0.5]
    assert result.per_reward["exact_match"] == [1.0, 1.0, 0.0]
    assert result.num_timeouts == {"exact_match": 0, key: 1}
    assert result.num_errors == {"exact_match": 0, key: 0}
    assert result.error_examples == {key: "timed out after 0.2 s"}


def test_thread_runner_returns_when_the_last_calls_time_out(user_module: str) -> None:
    """Every call overdue (the last ones to settle are timeouts): the batch ends at the deadline. It used to
    wait forever here, so the batch runs on a watched thread: a regression fails after 20 s, it never hangs."""
    import threading

    key = f"{user_module}:slow"
    reward = build_reward_fn([RewardSpec(key)], timeout_s=0.2)
    out: list[Any] = []
    worker = threading.Thread(
        target=lambda: out.append(reward.score(["slow"] * 3, _records([None] * 3))), daemon=True
    )
    worker.start()
    worker.join(timeout=20)
    assert out, "the thread runner did not return after every call timed out"
    assert out[0].num_timeouts == {key: 3} and out[0].per_reward[key] == [0.0, 0.0, 0.0]


def test_pickles_without_functions_and_rebuilds(user_module: str) -> None:
    reward = build_reward_fn([RewardSpec(f"{user_module}:quarter"), RewardSpec("exact_match", weight=2.0)])
    reward.score(["x"], _records(["x"]))  # builds the runner first: it must not travel either
    clone = pickle.loads(pickle.dumps(reward))  # a module-level lambda itself does not pickle
    result = clone.score(["blue"], _records(["blue"]))
    assert result.total == [2.25]  # 0.25 + 2 * 1
    assert clone.keys == reward.keys


# ---------------------------------------------------------------- isolation (process)


def test_process_isolation_survives_crash_and_hang(user_module: str) -> None:
    key = f"{user_module}:crash_or_hang"
    with CombinedReward(
        [RewardSpec(key), RewardSpec("exact_match")], timeout_s=0.5, isolation="process"
    ) as reward:
        result = reward.score(["ok", "die", "blue", "hang", "ok"], _records(["ok", "x", "blue", "x", "no"]))
        assert result.per_reward[key] == [0.25, 0.0, 0.25, 0.0, 0.25]
        assert result.per_reward["exact_match"] == [1.0, 0.0, 1.0, 0.0, 0.0]  # scored by fresh children
        assert result.total == [1.25, 0.0, 1.25, 0.0, 0.25]
        assert result.num_errors == {key: 1, "exact_match": 0}
        assert result.num_timeouts == {key: 1, "exact_match": 0}
        assert result.error_examples[key] == "reward worker process died (exit code 3)"
        # The runner keeps working across batches, and reports user exceptions like the thread runner.
        again = reward.score(["blue"], _records(["blue"]))
        assert again.total == [1.25]


def test_process_isolation_reports_errors_and_child_import_failure(user_module: str, tmp_path: Path) -> None:
    boom = RewardSpec(f"{user_module}:boom")
    with build_reward_fn([boom], isolation="process") as reward:
        result = reward.score(["boom", "fine"], _records([None, None]))
        assert result.per_reward[boom.name] == [0.0, 1.0]
        assert result.error_examples[boom.name] == "RuntimeError: kaboom"
    # Resolvable here but not in the child (the module vanished): the child's import error surfaces.
    reward = build_reward_fn([boom], isolation="process")
    (tmp_path / f"{user_module}.py").unlink()
    with pytest.raises(
        RewardConfigError, match=f"in the reward worker process: reward '{boom.name}': importing"
    ):
        reward.score(["x"], _records([None]))
