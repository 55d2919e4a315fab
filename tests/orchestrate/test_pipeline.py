"""The prefetch of one-step-off rollouts (orchestrate.pipeline) without Ray: a plain function stands in for
phases 1-3, so what is checked is the bookkeeping: which step a batch is for, the data position a checkpoint
saves, errors and stop requests raised where the loop can handle them."""

from __future__ import annotations

import logging
import threading

import pytest

from visionrl.config import config_from_dict
from visionrl.config_yaml import apply_overrides
from visionrl.errors import Preempted
from visionrl.orchestrate.pipeline import Prefetch, warn_about_async_steps

MINIMAL = {
    "output_dir": "runs/x",
    "model": {"path": "models/base"},
    "data": {"train": "data/train.jsonl"},
    "rewards": [{"name": "exact_match"}],
}


def test_a_batch_collected_ahead_is_taken_by_its_step_only() -> None:
    main = threading.get_ident()
    with Prefetch[tuple[str, bool]]() as prefetch:
        prefetch.start(5, {"pos": 40}, lambda: ("batch 5", threading.get_ident() != main))
        assert prefetch.position == {"pos": 40}  # what a checkpoint of step 4 saves meanwhile
        prefetch.wait()
        assert prefetch.take(5) == ("batch 5", True)  # collected in the background thread
        assert prefetch.position is None and prefetch.take(6) is None  # nothing in flight: collect now
        prefetch.start(7, {"pos": 56}, lambda: ("batch 7", False))
        assert prefetch.take(8) is None  # a batch for another step is never used (and is dropped)


def test_two_batches_in_flight_are_refused() -> None:
    release = threading.Event()
    with Prefetch[int]() as prefetch:
        prefetch.start(2, {}, lambda: int(release.wait(10)))
        with pytest.raises(RuntimeError, match="a batch for step 2 is still in flight"):
            prefetch.start(3, {}, lambda: 3)
        release.set()


def test_an_error_of_the_collection_is_raised_by_wait() -> None:
    def fail() -> int:
        raise ValueError("engine broke")

    with Prefetch[int]() as prefetch:
        prefetch.start(2, {}, fail)
        with pytest.raises(ValueError, match="engine broke"):
            prefetch.wait()


def test_a_stop_request_drops_the_batch_and_keeps_its_data_position() -> None:
    def stopped() -> int:
        raise Preempted(15)

    with Prefetch[int]() as prefetch:
        prefetch.start(4, {"pos": 24}, stopped)
        prefetch.wait()  # no error: the loop checkpoints step 3 with the position before batch 4
        assert prefetch.position == {"pos": 24}
        assert prefetch.take(4) is None


ENGINE_OLD = ["algorithm.rollout_correction=off", "algorithm.old_logprobs=engine"]


def test_colocated_gpus_get_a_warning_that_nothing_overlaps(caplog: pytest.LogCaptureFixture) -> None:
    gpu = ["rollout.async_steps=1", "rollout.gpus_per_engine=0.5", "ray.learner_gpus=0.5", *ENGINE_OLD]
    with caplog.at_level(logging.WARNING, logger="visionrl.orchestrate.pipeline"):
        warn_about_async_steps(
            config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=1", *ENGINE_OLD]))
        )
        assert caplog.text == ""  # CPU, the recommended old policy: nothing to say
        warn_about_async_steps(config_from_dict(apply_overrides(MINIMAL, gpu)))
    assert "use ray.placement=split" in caplog.text


def test_async_steps_with_the_learners_old_policy_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="visionrl.orchestrate.pipeline"):
        warn_about_async_steps(config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=0"])))
        assert caplog.text == ""  # synchronous: the learner's old policy is the sampling one
        warn_about_async_steps(config_from_dict(apply_overrides(MINIMAL, ["rollout.async_steps=1"])))
    assert "fell back to chance on 3 of 3 seeds" in caplog.text
    assert "Set algorithm.old_logprobs=engine and algorithm.rollout_correction=off" in caplog.text
