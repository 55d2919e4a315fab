"""Continuous episodes (`envs.continuous`) against turn-by-turn ones, with scripted engines behind the stepping API
and the environments in this process: the same episodes, a slow environment holding only its own episode, failures
ending only theirs, and nothing left in the engine afterwards."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from PIL import Image
from tests.envs import sample_envs
from tests.envs.scripted import RecordingStepper, ScriptedEngine

from visionrl.config_env import EnvConfig
from visionrl.envs.episodes import EpisodeBatch, EpisodeRunner
from visionrl.envs.pool import LocalEnvs
from visionrl.models.loader import load_processor
from visionrl.rollout.stepping import BatchingStepper
from visionrl.types import PromptItem, SamplingSpec


def _records(answers: list[str], **extra: dict) -> list[PromptItem]:
    picture = Image.new("RGB", (32, 32), (0, 200, 0))
    return [
        PromptItem(
            "",
            [picture],
            answer=a,
            sample_id=f"s{i}",
            source_images=[picture],
            record={"prompt": "what color ?", "long": a == "blue", "name": f"s{i}", **extra.get(f"s{i}", {})},
        )  # fmt: skip
        for i, a in enumerate(answers)
    ]


def _episodes(batch: EpisodeBatch) -> list[tuple]:
    """Everything an episode holds (NaN log-probs as None, so that equal episodes compare equal)."""
    return [
        (
            c.token_ids,
            c.env_mask,
            [None if math.isnan(x) else x for x in c.logprobs],
            c.text,
            c.finish_reason,
            c.episode,
            len(c.images),
            failed,
        )
        for group, flags in zip(batch.completions, batch.failed, strict=True)
        for c, failed in zip(group, flags, strict=True)
    ]


@pytest.mark.parametrize("engines", [1, 2])
def test_continuous_episodes_are_the_turn_by_turn_episodes(tiny_model: Path, engines: int) -> None:
    processor = load_processor(tiny_model)
    env = EnvConfig(name="tests.envs.sample_envs:RetryColour", max_turns=3, max_images=8)
    records = _records(["red", "green", "green", "blue", "green"])
    spec = SamplingSpec(n=2, max_tokens=4, seed=3)
    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=512)
    turns = runner.run(records, [ScriptedEngine(processor).generate for _ in range(engines)], spec)
    steppers = [BatchingStepper(ScriptedEngine(processor).generate) for _ in range(engines)]
    continuous = runner.run(records, steppers, spec)

    assert _episodes(continuous) == _episodes(turns)
    ended = [c.episode["ended"] for g in continuous.completions for c in g]
    assert ended.count("done") == 8 and ended.count("truncated") == 2  # blue: cut by max_tokens
    assert {k: v for k, v in continuous.metrics.items() if k != "timing/env_s"} == {
        k: v for k, v in turns.metrics.items() if k != "timing/env_s"
    }
    assert [p.record["name"] for p in continuous.prompts] == [f"s{i}" for i in range(5)]  # groups by record
    assert not any(s.busy() for s in steppers)  # no request left in the engines


@pytest.mark.parametrize("pipeline", ["continuous", "turns"])
def test_a_slow_environment_holds_only_its_own_episode(tiny_model: Path, pipeline: str) -> None:
    """The slow record's environment answers only once the fast record's second turn went to the engine (the
    engine opens the gate then): continuous episodes get there; turn by turn, the fast episode's second turn waits
    for the slow environment, which gives up waiting for the gate first."""
    processor = load_processor(tiny_model)
    env = EnvConfig(name="tests.envs.sample_envs:Gated", max_turns=3, max_images=8)
    records = _records(["green", "green"], s1={"slow": True})
    records[0].record["name"], records[1].record["name"] = "fast", "slow"
    sample_envs.EVENTS.clear()
    sample_envs.GATE.clear()
    sample_envs.GATE_WAIT_S["s"] = 5.0 if pipeline == "continuous" else 0.3
    engine = RecordingStepper(ScriptedEngine(processor))
    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=512)
    lane = engine if pipeline == "continuous" else engine.generate
    batch = runner.run(records, lane, SamplingSpec(n=1, max_tokens=4))

    events = sample_envs.EVENTS
    fast_second, slow_answer = events.index(("submit", "fast", 2)), events.index(("answered", "slow", 1))
    assert (fast_second < slow_answer) == (pipeline == "continuous")
    assert [g[0].episode["ended"] for g in batch.completions] == ["done", "done"]
    assert [g[0].episode["env_reward"] for g in batch.completions] == [0.5, 0.5]  # right at the second try
    assert events[-2:] == [("submit", "slow", 2), ("answered", "slow", 2)]  # the gate open: at once


def test_a_failing_or_slow_environment_ends_only_its_episode_in_continuous_mode(tiny_model: Path) -> None:
    processor = load_processor(tiny_model)
    env = EnvConfig(name="tests.envs.sample_envs:Failing", max_turns=3, step_timeout_s=0.5)
    records = _records(["red", "green", "blue"])
    for r in records:
        r.record["long"] = False  # blue's turns stop, and its environment sleeps past the deadline
    stepper = BatchingStepper(ScriptedEngine(processor).generate)
    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=512)
    batch = runner.run(records, stepper, SamplingSpec(n=2, max_tokens=4))

    assert [[c.episode["ended"] for c in g] for g in batch.completions] == [
        ["error", "error"],
        ["done", "done"],
        ["timeout", "timeout"],
    ]
    assert batch.failed == [[True, True], [False, False], [True, True]]
    assert [[c.episode["env_reward"] for c in g] for g in batch.completions] == [
        [0.0] * 2,
        [0.5] * 2,
        [0.0] * 2,
    ]
    assert batch.metrics["episode/ended_error"] == 2 and batch.metrics["episode/ended_timeout"] == 2
    assert not stepper.busy()
