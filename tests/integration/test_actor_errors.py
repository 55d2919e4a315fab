"""Errors raised inside Ray actors reach the user with their cause: the actor's role and index, the phase, the
exception raised inside it and what to do (out-of-memory: the memory settings); the traceback goes to the run's
log file; a call past its deadline names the stuck actor; a stop request ends an interruptible wait."""

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
    """Stands in for an actor method: raises inside the memory guard, as the learner actor's methods do."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def oom(self) -> None:
        from visionrl.orchestrate.actors import memory_guard

        with memory_guard("learner", "train_step", self.cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def bad_value(self) -> None:
        raise ValueError("prompt has 5000 tokens, longer than max_model_len 4096")

    def slow(self) -> None:
        import time

        time.sleep(60)

    def pid(self) -> int:
        import os

        return os.getpid()


def test_errors_inside_actors_reach_the_user_with_their_cause(tmp_path: Path) -> None:
    import signal

    from visionrl.errors import Preempted
    from visionrl.orchestrate import preemption
    from visionrl.orchestrate.failures import run_error, run_log
    from visionrl.orchestrate.ray_session import ray_session
    from visionrl.orchestrate.remote import ENGINE, LEARNER, ActorFailed, ActorHung, Call, gather
    from visionrl.rollout.scratch import process_alive
    from visionrl.run_layout import RunDir

    cfg = _cfg(tmp_path)
    run = RunDir.of(tmp_path / "run")
    with ray_session(cfg.ray), run_log(run):
        actor = _Failing.options(num_cpus=0).remote(cfg)
        with pytest.raises(ActorFailed) as oom:
            gather([Call(actor.oom.remote(), LEARNER, 0)], "update", 60, "ray.call_timeout_s")
        # engine 1 fails while engine 0 is still busy: the failure is seen first, and named
        other = _Failing.options(num_cpus=0).remote(cfg)  # keep the handle: a dropped one ends the actor
        pids = ray.get([actor.pid.remote(), other.pid.remote()])
        slow, bad = actor.slow.remote(), other.bad_value.remote()
        with pytest.raises(ActorFailed) as failed:
            gather([Call(slow, ENGINE, 0), Call(bad, ENGINE, 1)], "rollout", 30, "ray.call_timeout_s")
        with pytest.raises(ActorHung) as hung:
            gather([Call(actor.slow.remote(), ENGINE, 0)], "rollout", 1, "ray.call_timeout_s")
        with preemption.stop_on_signals():
            preemption._on_signal(signal.SIGTERM, None)  # what the handler does when SIGTERM arrives
            with pytest.raises(Preempted) as stop:
                gather([Call(actor.slow.remote(), ENGINE, 0)], "rollout", 30, "k", interruptible=True)
        assert stop.value.exit_status == 143
        err = run_error(failed.value, run.root)
        oom_err = run_error(oom.value, run.root)
    # The session has ended: both actors' processes are gone (one of them was still in a 60 s call), not
    # on their way out, so their scratch folders can be removed and nothing of the run is left running.
    assert [pid for pid in pids if process_alive(pid)] == []
    assert isinstance(oom_err, OutOfMemory)
    text = str(oom_err)
    assert text.startswith("the learner ran out of memory during train_step.")
    assert (
        "train.micro_batch_tokens (now 12345)" in text and "rollout.gpu_memory_utilization (now 0.4)" in text
    )
    assert "Tried to allocate 20.00 GiB" in text and "no checkpoint was written yet" in text
    assert "train.gpu_memory_gib (now null; null: the whole card) is the learner's own cap" in text
    assert "ray::" not in text and "pid=" not in text
    assert type(err) is RunError
    lines = str(err).splitlines()
    assert lines[0] == (
        "the rollout engine 1 failed during rollout: ValueError: prompt has 5000 tokens, longer than "
        "max_model_len 4096"
    )
    assert lines[1].startswith("To fix: the engine refused a prompt") and "rollout.max_model_len" in lines[1]
    assert lines[2] == f"The full traceback is in {run.log}."
    assert lines[3] == "no checkpoint was written yet"
    log = run.log.read_text()
    assert "rollout engine 1 failed during rollout; its traceback:" in log
    assert "in bad_value" in log and 'raise ValueError("prompt has 5000 tokens' in log  # the remote frames
    assert str(hung.value).startswith(
        "the rollout engine 0 did not answer within 1 s during rollout (ray.call_timeout_s): it is stuck"
    )
