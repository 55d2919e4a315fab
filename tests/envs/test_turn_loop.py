"""The turn loop with scripted engines and the environments in this process: episodes end for the reasons
counted, alike on one engine or in one lane per engine, and their images stay within max_images."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from tests.envs.scripted import ScriptedEngine

from visionrl.config_env import EnvConfig
from visionrl.envs.episodes import EpisodeRunner
from visionrl.envs.pool import LocalEnvs
from visionrl.models.loader import load_processor
from visionrl.types import PromptItem, SamplingSpec


def _records() -> list[PromptItem]:
    picture = Image.new("RGB", (32, 32), (0, 200, 0))
    answers = ["red", "green", "green", "blue"]
    return [
        PromptItem(
            "",
            [picture],
            answer=a,
            record={"prompt": "what color ?", "long": a == "blue"},
            sample_id=f"s{i}",
            source_images=[picture],
        )  # fmt: skip
        for i, a in enumerate(answers)
    ]


@pytest.mark.parametrize("engines", [1, 2])
def test_episodes_end_for_their_reasons_alike_on_one_engine_or_in_lanes(
    tiny_model: Path, engines: int
) -> None:
    processor = load_processor(tiny_model)
    env = EnvConfig(name="tests.envs.sample_envs:RetryColour", max_turns=3, max_images=8)
    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=512)
    scripted = [ScriptedEngine(processor) for _ in range(engines)]
    lanes = [e.generate for e in scripted] if engines > 1 else scripted[0].generate
    batch = runner.run(_records(), lanes, SamplingSpec(n=2, max_tokens=4, seed=0))
    ended = [[c.episode["ended"] for c in group] for group in batch.completions]
    # red: right at once; green: right at the second try (after the picture again); blue: cut by max_tokens
    assert ended == [["done", "done"], ["done", "done"], ["done", "done"], ["truncated", "truncated"]]
    assert [[c.episode["turns"] for c in g] for g in batch.completions] == [[1, 1], [2, 2], [2, 2], [1, 1]]
    assert [[c.episode["env_reward"] for c in g] for g in batch.completions] == [
        [1.0, 1.0],
        [0.5, 0.5],
        [0.5, 0.5],
        [0.0, 0.0],
    ]
    assert [len(c.images) for c in batch.completions[1]] == [1, 1]  # the picture shown again, once
    assert batch.metrics["episode/ended_done"] == 6 and batch.metrics["episode/ended_truncated"] == 2
    assert batch.metrics["episode/replay_mismatches"] == 0
    # two turns: on one engine two batches; in lanes, each engine two batches of its own records (0, 2 / 1, 3)
    assert [e.calls for e in scripted] == ([2] if engines == 1 else [2, 2])
    second = batch.completions[1][0]
    assert "[user: <image> look again]" in second.episode["transcript"]


def test_an_episode_past_its_image_budget_ends_counted(tiny_model: Path) -> None:
    processor = load_processor(tiny_model)
    env = EnvConfig(name="tests.envs.sample_envs:Solid", max_turns=5, max_images=3)
    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=512)
    batch = runner.run(_records()[:1], ScriptedEngine(processor).generate, SamplingSpec(n=1, max_tokens=4))
    c = batch.completions[0][0]
    assert (
        c.episode["ended"] == "max_images" and len(c.images) == 2
    )  # the prompt's picture and two observations
    assert batch.metrics["episode/images_mean"] == 3
