"""Pure helpers of the loop: building the train batch (dynamic sampling), step metrics, the step clock."""

from __future__ import annotations

import pytest
import torch

from visionrl.config import config_from_dict
from visionrl.orchestrate.loop import StepClock, _step_metrics, _train_batch
from visionrl.rewards import RewardResult
from visionrl.rollout.types import Completion, PromptItem


def _cfg(dynamic: bool):  # noqa: ANN202
    return config_from_dict(
        {
            "output_dir": "x",
            "model": {"path": "m"},
            "data": {"train": "t.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "algorithm": {"group_size": 2, "dynamic_sampling": dynamic},
            "rollout": {"prompts_per_step": 3},
        }
    )


def _groups() -> list[list[Completion]]:
    # 3 prompts x 2 completions; token counts 1..6; the second completion of prompt 2 hit max_tokens.
    out = []
    for i in range(3):
        out.append(
            [
                Completion(
                    i,
                    [7] * (2 * i + j + 1),
                    "x",
                    [-0.5] * (2 * i + j + 1),
                    "length" if (i, j) == (2, 1) else "stop",
                )
                for j in range(2)
            ]
        )
    return out


@pytest.mark.parametrize("dynamic", [False, True])
def test_train_batch_drops_groups_without_signal_only_with_dynamic_sampling(dynamic: bool) -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # prompt 0 has signal; prompts 1 and 2 do not
    adv = torch.tensor([0.7, -0.7, 0.0, 0.0, 0.0, 0.0])
    prompts = [PromptItem(text=f"p{i}", images=[]) for i in range(3)]
    batch = _train_batch(prompts, _groups(), adv, rewards, _cfg(dynamic))
    kept = sorted({s.prompt for s in batch.sequences})
    assert kept == ([0] if dynamic else [0, 1, 2])
    assert [s.advantage for s in batch.sequences if s.prompt == 0] == pytest.approx([0.7, -0.7])


def test_step_metrics_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    scores = RewardResult(
        total=rewards.tolist(),
        per_reward={"exact_match": rewards.tolist()},
        num_errors={"exact_match": 1},
        num_timeouts={"exact_match": 0},
        error_examples={},
    )
    m = _step_metrics(rewards, _groups(), scores, {"loss/policy": 0.25, "update_s": 9.0}, 2, 2)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx(0.5)  # population std of three 1s and three 0s
    assert m["reward/zero_std_fraction"] == pytest.approx(2 / 3)
    assert m["response/length_mean"] == pytest.approx(3.5)  # lengths 1..6
    assert m["response/length_max"] == 6.0
    assert m["response/truncated_fraction"] == pytest.approx(1 / 6)
    assert m["response/tokens"] == 21.0
    assert m["rollout/groups_kept"] == 1.0  # 2 sequences of group size 2
    assert m["reward/errors"] == 1.0
    assert m["loss/policy"] == 0.25 and "update_s" not in m  # learner metrics without a '/' stay out


def test_step_clock_reports_each_phase_and_the_step() -> None:
    clock = StepClock()
    clock.start()
    with clock("rollout"):
        pass
    with clock("update"):
        pass
    m = clock.metrics()
    assert set(m) == {"timing/rollout_s", "timing/update_s", "timing/step_s"}
    assert (
        0 <= m["timing/rollout_s"] <= m["timing/step_s"] and 0 <= m["timing/update_s"] <= m["timing/step_s"]
    )
