"""Multi-turn episodes through the real loop (Ray actors, env workers, the pre-trained tiny Qwen3-VL): vLLM continues
each episode from its token ids, image observations included, and the learner scores exactly what it sampled; the
environment's tokens stay out of the loss and the counts; a failing or slow environment ends its episodes only."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.integration.small_job import small_job

from visionrl import metrics as tags
from visionrl.metrics import read_scalars

pytestmark = pytest.mark.slow


def test_episodes_with_image_observations_train_token_exact_on_vllm(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    from visionrl.orchestrate.loop import train

    cfg = small_job(
        pretrained_tiny_model,
        color_data,
        tmp_path / "run",
        env={"name": "tests.envs.sample_envs:RetryColour", "max_turns": 3, "pipeline": "continuous"},
        rewards=[],  # the environment's rewards only
        rollout={"engine": "vllm", "prompts_per_step": 4, "max_new_tokens": 3, "max_model_len": 512},
        logging={"save_every": 100, "images_every": 1, "eval_every": 100},
    )
    result = train(cfg)
    for h in result.history:
        ended = {k: v for k, v in h.items() if k.startswith(tags.EPISODE_ENDED_PREFIX)}
        assert sum(ended.values()) == 16  # 4 records x 4 episodes, each ended once, for a reason
        assert set(ended) <= {f"{tags.EPISODE_ENDED_PREFIX}{w}" for w in ("done", "max_turns")}
        assert 1.0 <= h[tags.EPISODE_TURNS] <= 3.0
        assert h[tags.EPISODE_REPLAY_MISMATCHES] == 0.0  # the tokens are the conversation, rendered whole
        # vLLM sampled every turn after the observations' images; the learner scores the same tokens the same
        assert h[tags.LOGPROB_DIFF] < 1e-3
        # rewards: 1 right at once, 0.5 right at the second try, 0 else (the environment's only)
        assert h[tags.REWARD_MEAN] == pytest.approx(h[tags.EPISODE_ENV_REWARD])
        assert h[tags.EPISODE_IMAGES] == pytest.approx(h[tags.EPISODE_TURNS])  # one picture per turn
    # episodes that needed a second try hold environment tokens, which are neither trained nor counted
    assert any(h[tags.EPISODE_ENV_TOKENS] > 0 for h in result.history)
    assert all(h["learner/tokens"] == h[tags.RESPONSE_TOKENS] for h in result.history)
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars[tags.EPISODE_TURNS]] == [1, 2]


def test_a_failing_or_slow_environment_ends_only_its_episodes(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    from visionrl.orchestrate.loop import train

    cfg = small_job(
        pretrained_tiny_model,
        color_data,
        tmp_path / "run",
        env={
            "name": "tests.envs.sample_envs:Failing",
            "max_turns": 2,
            "step_timeout_s": 2.0,
            "num_workers": 2,
        },
        data={"train": str(color_data / "train.jsonl"), "balance_key": "answer"},
        rollout={"engine": "hf", "prompts_per_step": 8, "max_new_tokens": 3, "max_model_len": 512},
        train={"steps": 1},
        logging={"save_every": 100, "images_every": 100, "eval_every": 100},
    )
    result = train(cfg)
    h = result.history[0]
    # red's environment raises, blue's sleeps past the deadline: 4 episodes each (balanced records), reward 0
    assert h[f"{tags.EPISODE_ENDED_PREFIX}error"] >= 4 and h[f"{tags.EPISODE_ENDED_PREFIX}timeout"] >= 4
    others = sum(v for k, v in h.items() if k.startswith(tags.EPISODE_ENDED_PREFIX))
    assert others == 32
    assert result.steps == 1


def test_continuous_episodes_through_ray_are_the_turn_by_turn_episodes_on_vllm(
    pretrained_tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """One vLLM rollout actor and the env workers (Ray): greedy episodes of three turns with a picture each turn
    come out the same turn by turn and continuous (log-probs within the prefix cache's rounding), and nothing is
    left in the engine afterwards."""
    import math

    import ray

    from visionrl.data import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.envs.episodes import EpisodeRunner
    from visionrl.models.loader import load_processor
    from visionrl.orchestrate.actors import RolloutActor, engine_budget
    from visionrl.orchestrate.engine_lanes import EngineLane
    from visionrl.orchestrate.env_workers import EnvPool
    from visionrl.orchestrate.workers import Workers
    from visionrl.types import SamplingSpec

    cfg = small_job(
        pretrained_tiny_model,
        color_data,
        tmp_path / "run",
        env={"name": "tests.envs.sample_envs:Solid", "max_turns": 3, "num_workers": 2},
        rollout={"engine": "vllm", "max_new_tokens": 3, "max_model_len": 512},
    )
    engine = RolloutActor.options(num_cpus=0).remote(cfg, [], 0, 0)  # type: ignore[attr-defined]
    assert cfg.env is not None
    pool = EnvPool(cfg.env)
    try:
        processor = load_processor(pretrained_tiny_model, engine_budget(cfg))
        records = [
            build_prompt(s, processor, keep_source=True)
            for s in list(load_dataset(color_data / "train.jsonl"))[:4]
        ]
        workers = Workers([], [engine], [], cfg)
        runner = EpisodeRunner.of(cfg, processor, pool)
        spec = SamplingSpec(n=2, greedy=True, max_tokens=3)
        turns = runner.run(records, workers.rollout_lanes(), spec)
        continuous = runner.run(records, [EngineLane(workers, 0)], spec)
        assert not ray.get(engine.in_flight.remote())
    finally:
        pool.kill()
        ray.kill(engine)
    pairs = [(a, b) for ga, gb in zip(turns.completions, continuous.completions, strict=True) for a, b in zip(ga, gb, strict=True)]  # fmt: skip
    for a, b in pairs:
        assert (b.token_ids, b.env_mask, b.episode, len(b.images)) == (
            a.token_ids,
            a.env_mask,
            a.episode,
            len(a.images),
        )
        assert all(math.isnan(x) == math.isnan(y) for x, y in zip(a.logprobs, b.logprobs, strict=True))
        assert (
            max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True) if not math.isnan(x)) < 1e-3
        )
    assert [c.episode["ended"] for g in continuous.completions for c in g] == ["max_turns"] * 8
    assert (
        continuous.metrics["episode/turns_mean"] == 3 and continuous.metrics["episode/replay_mismatches"] == 0
    )
