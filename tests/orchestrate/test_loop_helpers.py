"""Pure helpers of the loop: collecting a step's batch (dynamic sampling, rejected prompts), building the train
batch, step metrics, the step clock, reward shaping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from visionrl.config import config_from_dict
from visionrl.orchestrate.collect import Collected, collect
from visionrl.orchestrate.loop import _train_batch, evaluations_so_far
from visionrl.orchestrate.step_log import StepClock, step_metrics
from visionrl.rewards import RewardResult
from visionrl.types import Completion, PromptItem, SamplingSpec


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


class _FakeStream:
    """Batches of 2 prompts named p0, p1, p2, ..."""

    def __init__(self) -> None:
        self.n = 0

    def next_batch(self) -> list[PromptItem]:
        self.n += 2
        return [PromptItem(text=f"p{self.n - 2 + k}", images=[]) for k in range(2)]


class _FakeWorkers:
    """Completions whose rewards follow `pattern[prompt index]` (a group of 2): (1, 0) has signal, (1, 1) not."""

    def __init__(
        self, pattern: dict[int, tuple[float, float]], rejected: frozenset[int] = frozenset()
    ) -> None:
        self.pattern = pattern
        self.rejected = rejected  # prompt indices the engine rejects (no completions)
        self.episodes = None  # single-turn

    def rollout(self, prompts: list[PromptItem], spec) -> list[list[Completion]]:
        return [
            []
            if int(p.text[1:]) in self.rejected
            else [Completion(i, [1, 2], p.text, [-0.1, -0.2], "stop") for _ in range(2)]
            for i, p in enumerate(prompts)
        ]

    def score(self, prompts: list[PromptItem], groups: list[list[Completion]]) -> RewardResult:
        total = [r for p in prompts for r in self.pattern[int(p.text[1:])]]
        return RewardResult(
            total=total,
            per_reward={"r": total},
            num_errors={"r": 0},
            num_timeouts={"r": 0},
            error_examples={},
        )


def _cfg2(dynamic: bool, rounds: int = 3):
    return config_from_dict(
        {
            "output_dir": "x",
            "model": {"path": "m"},
            "data": {"train": "t.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "algorithm": {"group_size": 2, "dynamic_sampling": dynamic, "max_sampling_rounds": rounds},
            "rollout": {"prompts_per_step": 2},
        }
    )


SIGNAL, FLAT = (1.0, 0.0), (1.0, 1.0)


def test_collect_without_dynamic_sampling_keeps_one_batch_whole() -> None:
    workers = _FakeWorkers({0: FLAT, 1: SIGNAL})
    got = collect(_FakeStream(), workers, SamplingSpec(n=2), _cfg2(False), StepClock())
    assert (
        [p.text for p in got.prompts] == ["p0", "p1"]
        and got.keep.tolist() == [True, True]
        and got.rounds == 1
    )


def test_collect_with_dynamic_sampling_samples_until_the_step_is_full_of_signal() -> None:
    # round 1: p0 flat, p1 signal; round 2: p2 flat, p3 signal -> 2 groups with signal, stop after 2 rounds.
    workers = _FakeWorkers({0: FLAT, 1: SIGNAL, 2: FLAT, 3: SIGNAL, 4: SIGNAL, 5: SIGNAL})
    got = collect(_FakeStream(), workers, SamplingSpec(n=2), _cfg2(True), StepClock())
    assert got.rounds == 2
    assert [p.text for p in got.prompts] == ["p0", "p1", "p2", "p3"]
    assert got.keep.tolist() == [False, True, False, True]
    assert got.rewards.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]  # metrics see every sampled group
    batch = _train_batch(got, torch.tensor([0.0, 0, 0.7, -0.7, 0, 0, 0.7, -0.7]), 2)
    assert [s.prompt for s in batch.sequences] == [1, 1, 3, 3]
    assert [s.advantage for s in batch.sequences] == pytest.approx([0.7, -0.7, 0.7, -0.7])


def test_collect_stops_after_max_rounds_and_drops_surplus_groups() -> None:
    # only flat groups for 2 rounds (max): nothing to train on; surplus: 3 signal groups found for 2 slots.
    flat = collect(
        _FakeStream(),
        _FakeWorkers({i: FLAT for i in range(10)}),
        SamplingSpec(n=2),
        _cfg2(True, rounds=2),
        StepClock(),
    )
    assert flat.rounds == 2 and flat.keep.tolist() == [False] * 4
    surplus = collect(
        _FakeStream(),
        _FakeWorkers({0: FLAT, 1: SIGNAL, 2: SIGNAL, 3: SIGNAL}),
        SamplingSpec(n=2),
        _cfg2(True),
        StepClock(),
    )
    assert surplus.keep.tolist() == [False, True, True, False]


def test_prompts_the_engine_rejected_are_left_out_and_counted() -> None:
    workers = _FakeWorkers({1: SIGNAL}, rejected=frozenset({0}))
    got = collect(_FakeStream(), workers, SamplingSpec(n=2), _cfg2(False), StepClock())
    assert [p.text for p in got.prompts] == ["p1"] and got.keep.tolist() == [True]
    assert (got.skipped, got.rounds, got.rewards.tolist()) == (1, 1, [1.0, 0.0])


def test_a_batch_the_engine_rejected_whole_is_replaced_by_the_next() -> None:
    workers = _FakeWorkers({2: SIGNAL, 3: FLAT}, rejected=frozenset({0, 1}))
    got = collect(_FakeStream(), workers, SamplingSpec(n=2), _cfg2(False), StepClock())
    assert [p.text for p in got.prompts] == ["p2", "p3"] and (got.skipped, got.rounds) == (2, 1)


def test_batch_after_batch_rejected_stops_the_run_with_the_cause() -> None:
    from visionrl.errors import RunError
    from visionrl.orchestrate.collect import MAX_REJECTED_BATCHES

    stream = _FakeStream()
    workers = _FakeWorkers({}, rejected=frozenset(range(100)))
    with pytest.raises(RunError, match=f"rejected every prompt of {MAX_REJECTED_BATCHES} batches in a row"):
        collect(stream, workers, SamplingSpec(n=2), _cfg2(False), StepClock())
    assert stream.n == 2 * MAX_REJECTED_BATCHES


def test_step_metrics_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    scores = RewardResult(
        total=rewards.tolist(),
        per_reward={"exact_match": rewards.tolist()},
        num_errors={"exact_match": 1},
        num_timeouts={"exact_match": 0},
        error_examples={},
    )
    m = step_metrics(rewards, _groups(), scores, {"loss/policy": 0.25, "update_s": 9.0}, 2, 1)
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx(0.5)  # population std of three 1s and three 0s
    assert m["reward/zero_std_fraction"] == pytest.approx(2 / 3)
    assert m["response/length_mean"] == pytest.approx(3.5)  # lengths 1..6
    assert m["response/length_max"] == 6.0
    assert m["response/truncated_fraction"] == pytest.approx(1 / 6)
    assert m["response/tokens"] == 21.0
    assert m["rollout/groups_kept"] == 1.0
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


def _shaping_cfg(**algorithm: object):
    return config_from_dict(
        {
            "output_dir": "x",
            "model": {"path": "m"},
            "data": {"train": "t.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "algorithm": {"group_size": 2, **algorithm},
            "rollout": {"prompts_per_step": 3, "max_new_tokens": 6},
        }
    )


def test_overlong_shaping_adds_the_dapo_ramp_to_the_rewards() -> None:
    from visionrl.orchestrate.loop import _shape_rewards

    # lengths 1..6, max_new_tokens 6, buffer 4: the ramp starts after 6 - 4 = 2 tokens and reaches -factor at 6:
    # penalty = -0.5 * (len - 2) / 4 -> 0, 0, -0.125, -0.25, -0.375, -0.5
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    shaped, m = _shape_rewards(rewards, _groups(), _shaping_cfg(overlong_buffer=4, overlong_factor=0.5))
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.0, 0.875, -0.25, 0.625, -0.5]))
    assert m["response/overlong_penalized"] == 4.0
    assert m["reward/overlong_penalty_mean"] == pytest.approx(-1.25 / 6)
    same, m_off = _shape_rewards(rewards, _groups(), _shaping_cfg())
    assert same is rewards and m_off["response/overlong_penalized"] == 0.0


def test_mask_truncated_leaves_cut_completions_out_of_the_loss() -> None:
    from visionrl.orchestrate.loop import _shape_rewards

    adv = torch.arange(6, dtype=torch.float32)
    keep = torch.ones(3, dtype=torch.bool)
    prompts = [PromptItem(text=f"p{i}", images=[]) for i in range(3)]
    got = Collected(prompts, _groups(), RewardResult(total=[0.0] * 6, per_reward={}), torch.zeros(6), keep, 1)
    full = _train_batch(got, adv, 2)
    masked = _train_batch(got, adv, 2, mask_truncated=True)
    assert len(full.sequences) == 6
    # the one completion that hit max_tokens (prompt 2, second sample, advantage 5) is left out
    assert [s.advantage for s in masked.sequences] == [0.0, 1.0, 2.0, 3.0, 4.0]
    _, m = _shape_rewards(torch.zeros(6), _groups(), _shaping_cfg(mask_truncated=True))
    assert m["response/truncated_masked"] == 1.0


def test_a_restart_without_resume_into_a_run_with_checkpoints_is_refused(tmp_path) -> None:
    """A re-run of the same command must not overwrite a run's checkpoints: InputError (exit 2) before any
    data, model or Ray starts, and the folder is left as it was."""
    from visionrl.errors import InputError
    from visionrl.orchestrate.loop import train

    run = tmp_path / "run"
    (run / "checkpoints" / "step_4").mkdir(parents=True)
    cfg = config_from_dict({"output_dir": str(run), "model": {"path": "nowhere"}, "data": {"train": "none.jsonl"},
                            "rewards": [{"name": "exact_match"}]})  # fmt: skip
    with pytest.raises(InputError, match=r"holds checkpoints of an earlier run; continue it with `--resume`"):
        train(cfg)
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints", "step_4"]


def test_the_early_stop_count_carries_over_a_resume(tmp_path: Path) -> None:
    """The evaluations in a row at the target, read back from the history a resumed run starts from: a run
    stopped after one evaluation at the target stops after one more, not two."""
    history = tmp_path / "history.jsonl"
    records = [{"step": 10, "eval/accuracy": 0.95}, {"step": 15}, {"step": 20, "eval/accuracy": 0.7}]
    records += [{"step": 30, "eval/accuracy": 0.91}, {"step": 35}, {"step": 40, "eval/accuracy": 0.93}]
    history.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert evaluations_so_far(history, 0.9) == (0.93, 2)  # steps 30 and 40; step 20 ended the row before
    assert evaluations_so_far(history, 0.92) == (0.93, 1)
    assert evaluations_so_far(history, None) == (0.93, 0)  # no target: no early stop
    with history.open("a") as f:
        f.write(json.dumps({"step": 50, "eval/accuracy": None}) + "\n")  # an evaluation that failed
    assert evaluations_so_far(history, 0.9) == (None, 0)
    assert evaluations_so_far(tmp_path / "none.jsonl", 0.9) == (None, 0)  # nothing evaluated yet


@pytest.mark.parametrize(
    ("learner_gpus", "engine_gpus", "placement", "waits"),
    [
        (0.0, 0.0, "colocated", False),  # the CPU loop: the engines load beside the learners
        (0.5, 0.4, "colocated", True),  # a shared GPU: an engine sizes its share after the learner has loaded
        (1.0, 1.0, "split", False),  # GPUs of their own: the engines load beside the learners
        (0.5, 0.5, "split", True),  # Ray may pack both fractions onto one GPU
        (0.5, 1.0, "split", False),  # a whole GPU is never shared
        (1.0, 0.5, "split", False),
    ],
)
def test_engines_load_the_model_after_the_learners_only_where_they_may_share_a_gpu(
    learner_gpus: float, engine_gpus: float, placement: str, waits: bool
) -> None:
    from visionrl.orchestrate.scheduling import engines_wait_for_learners

    cfg = config_from_dict(
        {
            "output_dir": "out",
            "model": {"path": "nowhere"},
            "data": {"train": "none.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "rollout": {"gpus_per_engine": engine_gpus},
            "ray": {"learner_gpus": learner_gpus, "placement": placement},
        }
    )
    assert engines_wait_for_learners(cfg) is waits
