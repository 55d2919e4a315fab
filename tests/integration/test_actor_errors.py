"""Errors raised inside Ray actors reach the user with their cause: out-of-memory names actor, phase and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from visionrl.config import config_from_dict
from visionrl.errors import OutOfMemory, RunError

pytestmark = pytest.mark.slow


def _cfg(tmp_path: Path):
    return config_from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"path": "unused"},
            "data": {"train": "unused.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "train": {"micro_batch_tokens": 12345},
            "rollout": {"gpu_memory_utilization": 0.4},
        }
    )


@ray.remote
class _Failing:
    """Stands in for an actor method: raises inside the actor's memory guard, as the learner's `call` does."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def oom(self) -> None:
        from visionrl.orchestrate.actors import _memory_guard

        with _memory_guard("learner", "train_step", self.cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def bad_value(self) -> None:
        raise ValueError("prompt has 5000 tokens, longer than max_model_len 4096")


def test_errors_inside_actors_reach_the_user_with_their_cause(tmp_path: Path) -> None:
    from visionrl.orchestrate.actors import ray_session
    from visionrl.orchestrate.loop import run_error

    cfg = _cfg(tmp_path)
    with ray_session(cfg.ray):
        actor = _Failing.options(num_cpus=0).remote(cfg)
        with pytest.raises(ray.exceptions.RayTaskError) as oom:
            ray.get(actor.oom.remote())
        with pytest.raises(ray.exceptions.RayTaskError) as bad:
            ray.get(actor.bad_value.remote())
    err = run_error(oom.value, tmp_path / "run")
    assert isinstance(err, OutOfMemory)
    text = str(err)
    assert text.startswith("the learner ran out of memory during train_step.")
    assert (
        "train.micro_batch_tokens (now 12345)" in text and "rollout.gpu_memory_utilization (now 0.4)" in text
    )
    assert "Tried to allocate 20.00 GiB" in text and "no checkpoint was written yet" in text
    assert "ray::" not in text and "pid=" not in text
    err = run_error(bad.value, tmp_path / "run")
    assert type(err) is RunError
    assert str(err).splitlines()[0] == (
        "a worker of the run failed: ValueError: prompt has 5000 tokens, longer than max_model_len 4096"
    )
