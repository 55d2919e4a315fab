"""Tests of visionrl.orchestrate.health: when a run is training on nothing, and what it says."""

from __future__ import annotations

import logging
import math

import pytest

from visionrl import metrics as tags
from visionrl.config import AlgorithmConfig
from visionrl.errors import RunError
from visionrl.metrics import GRAD_NORM, LOSS_TOTAL, SKIPPED_UPDATES
from visionrl.orchestrate.health import CollapseWatch, RunHealth, failed_rewards
from visionrl.rewards import RewardResult


def _scores(
    n: int, errors: dict[str, int] | None = None, timeouts: dict[str, int] | None = None
) -> RewardResult:
    errors, timeouts = errors or {}, timeouts or {}
    examples = {k: f"ValueError: bad {k}" for k in errors}
    return RewardResult([0.0] * n, {"a": [0.0] * n}, errors, timeouts, examples)


def _stats(tried: int, skipped: int) -> dict[str, float]:
    return {"updates": tried, SKIPPED_UPDATES: skipped, LOSS_TOTAL: math.nan, GRAD_NORM: math.inf}


def test_failed_rewards_are_those_that_failed_on_every_sample() -> None:
    # 4 samples: 'a' raised on 2 and timed out on 2 (all 4 failed), 'b' raised on 3 of 4
    assert failed_rewards(_scores(4, {"a": 2, "b": 3}, {"a": 2})) == ["a"]
    assert failed_rewards(_scores(0)) == []


def test_consecutive_unusable_steps_stop_at_the_limit_and_a_good_step_resets() -> None:
    health = RunHealth(max_consecutive=2)
    health.after_step(1, _stats(2, 2), _scores(4))  # 1 in a row
    health.after_step(2, _stats(2, 1), _scores(4))  # one of two updates applied: usable, resets
    health.after_step(3, {}, _scores(4, {"a": 4}))  # no update tried, reward 'a' failed on all: 1 in a row
    with pytest.raises(RunError) as err:
        health.after_step(4, _stats(1, 1), _scores(4))
    text = str(err.value)
    assert text.startswith("2 steps in a row without a usable update (train.max_consecutive_skips=2)")
    assert "  - step 1: all 2 learner update(s) skipped: loss nan, gradient norm inf" in text
    assert "  - step 3: reward 'a' failed on all 4 samples: ValueError: bad a" in text
    assert "  - step 4: all 1 learner update(s) skipped" in text  # 3 errors so far: all shown (at most 3)
    assert (health.updates_applied, health.updates_skipped) == (1, 4)


def test_finish_refuses_a_run_that_never_applied_an_update_or_never_scored() -> None:
    skipped = RunHealth(max_consecutive=5)
    skipped.after_step(1, _stats(1, 1), _scores(2))
    with pytest.raises(RunError, match=r"every learner update of the run \(1\) was skipped"):
        skipped.finish()
    no_signal = RunHealth(max_consecutive=5)
    no_signal.after_step(1, _stats(1, 0), _scores(2, {"a": 2}))
    no_signal.after_step(2, _stats(1, 0), _scores(2, {}, {"a": 2}))
    with pytest.raises(RunError, match="a reward failed on every sample of all 2 steps"):
        no_signal.finish()
    healthy = RunHealth(max_consecutive=5)
    healthy.after_step(1, _stats(1, 0), _scores(2, {"a": 1}))  # one error of two samples: fine
    healthy.after_step(2, {}, _scores(2))  # dynamic sampling kept no group: nothing tried, nothing wrong
    healthy.finish()


def _metrics(entropy: float, signal: float) -> dict[str, float]:
    return {tags.ENTROPY: entropy, tags.GROUPS_WITH_SIGNAL: signal}


def test_collapse_warns_once_after_three_collapsed_steps_below_the_target_naming_the_remedies(
    caplog: pytest.LogCaptureFixture,
) -> None:
    algo = AlgorithmConfig(clip_high=0.2, entropy_coef=0.0, dynamic_sampling=False)
    watch = CollapseWatch(algo, target=0.9)
    caplog.set_level(logging.WARNING, logger="visionrl.orchestrate.health")
    # step 1 collapsed, step 2 not (entropy 0.3), then 3 collapsed in a row: the warning comes at the 3rd (step 5)
    steps = [(0.01, 0.0), (0.3, 0.0), (0.01, 0.03), (0.04, 0.0), (0.01, 0.0), (0.01, 0.0)]
    warned = [watch.after_step(i + 1, _metrics(e, s), 0.72) for i, (e, s) in enumerate(steps)]
    assert warned == [False, False, False, False, True, False]  # once per run
    (record,) = [r for r in caplog.records if "collapsed" in r.getMessage()]
    msg = record.getMessage()
    assert "step 5" in msg and "0.720" in msg and "target 0.9" in msg and "3 steps in a row" in msg
    # one on-policy mini-batch: its ratio is exactly 1, so the warning says where clip-higher can act
    assert (
        "algorithm.clip_high (now 0.2; DAPO clip-higher: 0.28; it acts only with updates_per_batch >= 2)"
        in msg
    )
    assert "algorithm.dynamic_sampling (now false; try true)" in msg
    assert "algorithm.entropy_coef (now 0.0; try 0.01)" in msg
    assert "algorithm.kl_coef (now 0.0; try 0.1: a KL to the base model" in msg
    assert "algorithm.updates_per_batch (now 1; try 2" in msg
    two = CollapseWatch(AlgorithmConfig(updates_per_batch=2), target=0.9).remedies()
    assert two[0] == "algorithm.clip_high (now 0.2; DAPO clip-higher: 0.28)"


def test_no_collapse_warning_at_the_target_or_with_signal_or_entropy() -> None:
    algo = AlgorithmConfig()
    at_target = CollapseWatch(algo, target=0.9)
    assert not any(at_target.after_step(s, _metrics(0.0, 0.0), 0.93) for s in range(1, 10))  # learned: fine
    with_signal = CollapseWatch(algo, target=0.9)  # deterministic-looking but 6% of groups still disagree
    assert not any(with_signal.after_step(s, _metrics(0.01, 0.06), 0.5) for s in range(1, 10))
    exploring = CollapseWatch(algo, target=0.9)
    assert not any(exploring.after_step(s, _metrics(0.06, 0.0), 0.5) for s in range(1, 10))
    no_eval_yet = CollapseWatch(algo, target=None)  # no target and no evaluation: a collapse is a collapse
    assert [no_eval_yet.after_step(s, _metrics(0.0, 0.0), None) for s in (1, 2, 3)] == [False, False, True]
    assert not CollapseWatch(algo, 0.9).after_step(
        1, {}, None
    )  # a step without learner stats: nothing to say
