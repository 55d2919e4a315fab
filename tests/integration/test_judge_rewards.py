"""Judge rewards in the real loop (Ray actors, the tiny Qwen3-VL): the rollout engines' base model as the only
reward (backend engine), a judge model in its own actor beside a rule reward (backend vllm) whose death costs
one step's judgements (scored on_error, counted) and not the run, a reward model in its own actor (backend
classifier); a hung judge call is counted as a timeout."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from visionrl.config import JobConfig, config_from_dict

pytestmark = pytest.mark.slow

TEMPLATE = (
    "Question: {question}\nProposed answer: {completion}\nIs the proposed answer right? Answer yes or no."
)


def _cfg(model: Path, data_dir: Path, out: Path, rewards: list[dict], **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data_dir / "train.jsonl")},
        "rewards": rewards,
        "lora": {"rank": 8, "alpha": 16},
        "algorithm": {"group_size": 4},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "max_new_tokens": 2, "max_model_len": 256},
        "train": {"lr": 3e-3, "torch_threads": 1, "steps": 2},
        "logging": {"save_every": 100, "images_every": 1, "eval_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


@pytest.fixture
def template(tmp_path: Path) -> Path:
    path = tmp_path / "judge.txt"
    path.write_text(TEMPLATE + "\n")
    return path


def test_the_engines_base_model_as_the_only_reward(
    tiny_model: Path, color_data: Path, tmp_path: Path, template: Path, shared_ray
) -> None:
    """backend engine: no reward worker, the engines judge with the adapter switched off; the judge's share of yes
    is the reward, logged with its mean, counts and time, and shown in the rollout pictures."""
    from visionrl.metrics import read_scalars, read_tags
    from visionrl.orchestrate.loop import train

    judge = {
        "name": "judge",
        "kwargs": {"backend": "engine", "template": str(template), "yes": ["yes"], "no": ["no"]},
    }
    result = train(_cfg(tiny_model, color_data, tmp_path / "run", [judge]))
    history = result.history
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert 0.0 < h["reward/judge_mean"] < 1.0 and h["reward/judge_mean"] == pytest.approx(
            h["reward/mean"]
        )
        assert (
            h["reward/judge_errors"] == 0.0
            and h["reward/judge_timeouts"] == 0.0
            and h["timing/judge_s"] > 0.0
        )
    assert (
        history[1]["rollout/adapter_version"] == 1.0
    )  # the adapter was trained and synced between the judgings
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["reward/judge_mean"]] == [1, 2]
    assert "reward/judge_hist" in read_tags(tmp_path / "run" / "tensorboard")["histograms"]


def test_a_judge_actor_beside_a_rule_reward_survives_its_death(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    template: Path,
    shared_ray,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """backend vllm: the judge model in its own actor (its own vLLM engine). It dies on its 2nd call (step 2): that
    step's judgements score on_error and are counted, Ray restarts the actor, step 3 is judged again; the total is
    the weighted sum of exact match and the judge."""
    from visionrl.orchestrate.loop import train

    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv("VISIONRL_FAULTS_DIR", str(faults))
    monkeypatch.setenv("VISIONRL_FAULTS", "kill_judge")
    kwargs = {
        "backend": "vllm",
        "model": str(tiny_model),
        "template": str(template),
        "yes": "yes",
        "no": "no",
    }
    kwargs.update(on_error=-0.5, timeout_s=120)
    rewards = [
        {"name": "exact_match", "kwargs": {"first_word": True}},
        {"name": "judge", "weight": 0.5, "kwargs": kwargs},
    ]
    result = train(_cfg(tiny_model, color_data, tmp_path / "run", rewards, train={"steps": 3}))
    assert (faults / "kill_judge.fired").is_file(), "the fault never fired: the test tests nothing"
    history = result.history
    assert [h["reward/judge_errors"] for h in history] == [0.0, 8.0, 0.0]
    assert history[1]["reward/judge_mean"] == -0.5  # every judgement of step 2 scored on_error
    assert all(
        0.0 < h["reward/judge_mean"] < 1.0 for h in (history[0], history[2])
    )  # judged again after the restart
    for h in history:
        expected = h["reward/component/exact_match"] + 0.5 * h["reward/component/judge"]
        assert h["reward/mean"] == pytest.approx(expected)
    log = (tmp_path / "run" / "visionrl.log").read_text()
    assert (
        "judge reward 'judge': 8 error(s) and 0 timeout(s)" in log
        and "the judge 0 died during judging" in log
    )


def test_a_reward_model_in_a_judge_actor_scores_the_conversation(
    tiny_reward_model: Path, tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """backend classifier: a reward model (the tiny VLM with a score head) in its own actor reads the question and
    the completion as a conversation (no template) and its sigmoid-squashed score is the only reward."""
    from visionrl.orchestrate.loop import train

    kwargs = {
        "backend": "classifier",
        "model": str(tiny_reward_model),
        "score": "scalar",
        "input": "conversation",
    }
    result = train(_cfg(tiny_model, color_data, tmp_path / "run", [{"name": "judge", "kwargs": kwargs}]))
    for h in result.history:
        assert 0.0 < h["reward/judge_mean"] < 1.0 and h["reward/judge_mean"] == pytest.approx(
            h["reward/mean"]
        )
        assert h["reward/judge_errors"] == 0.0 and h["timing/judge_s"] > 0.0
    log = (tmp_path / "run" / "visionrl.log").read_text()
    assert f"judge actors ({tiny_reward_model})" in log


def test_a_hung_or_dead_judge_call_is_counted_not_waited_for(shared_ray) -> None:
    """`settle` with real actors: a call past the deadline gives its samples a timeout (the actor is killed for Ray
    to restart), a dead actor's call an error; the answering actor's results are kept."""
    import ray

    from visionrl.orchestrate.judging import settle
    from visionrl.orchestrate.remote import JUDGE, Call
    from visionrl.rewards.judge import JudgeFailure

    @ray.remote(max_restarts=1)
    class Slow:
        def judge(self, n: int, wait: float, die: bool = False) -> list[float]:
            if die:
                import os

                os._exit(1)
            time.sleep(wait)
            return [0.25] * n

    actors = [Slow.remote() for _ in range(3)]
    # (the dead actor's call is waited on before the hung one's: Ray may take seconds to notice a death on a busy
    # machine, and the hung call uses up the shared deadline)
    calls = [
        (Call(actors[0].judge.remote(2, 0.0), JUDGE, 0), [0, 1]),
        (Call(actors[2].judge.remote(1, 0.0, True), JUDGE, 2), [3]),
        (Call(actors[1].judge.remote(1, 600.0), JUDGE, 1), [2]),
    ]
    t0 = time.monotonic()
    out = settle(calls, 4, timeout_s=8.0, kill_hung=actors)
    assert time.monotonic() - t0 < 30.0
    assert out[:2] == [0.25, 0.25]
    hung, dead = out[2], out[3]
    assert isinstance(hung, JudgeFailure) and hung.timeout and "did not answer within 8 s" in hung.message
    assert isinstance(dead, JudgeFailure) and not dead.timeout and "judge 2" in dead.message
    for actor in actors:
        ray.kill(actor)
