"""Faults injected inside the real Ray actors of a tiny run (visionrl.faults): dead and hung rollout engines and
reward workers are restarted and the step retried; a dead learner, or one fault too many, stops the run with
the actor, the phase and the checkpoint to resume from; a reward past its timeout never hangs the run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from visionrl.config import JobConfig, config_from_dict
from visionrl.errors import RunError

pytestmark = pytest.mark.slow


def _cfg(model: Path, data_dir: Path, out: Path, **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data_dir / "train.jsonl")},
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        "lora": {"rank": 8, "alpha": 16, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 4},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "max_new_tokens": 2, "max_model_len": 256},
        "train": {"lr": 1e-2, "lr_schedule": "constant", "torch_threads": 1, "steps": 3},
        "logging": {"eval_every": 100, "save_every": 1, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


@pytest.fixture
def inject(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Arms faults for the run (its actors get them in their environment, also on a shared Ray); restored
    after the test."""
    folder = tmp_path / "faults"
    folder.mkdir()
    monkeypatch.setenv("VISIONRL_FAULTS_DIR", str(folder))

    def arm(*names: str) -> Path:
        monkeypatch.setenv("VISIONRL_FAULTS", ",".join(names))
        return folder

    return arm


def _history(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("faults", "ray_over"),
    [
        # a frozen engine (a tiny rollout takes about a second, well under the 10 s deadline), then a dead
        # reward worker
        (("freeze_engine", "kill_reward_worker"), {"call_timeout_s": 10}),
        # a dead engine, then a stuck reward worker: 8 completions x 1 reward x 0.5 s + 10 s margin = 14 s deadline
        (("kill_engine", "hang_reward_worker"), {"reward_timeout_s": 0.5}),
    ],
)
def test_dead_or_hung_engines_and_reward_workers_are_restarted_and_the_step_retried(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    inject,
    faults: tuple[str, str],
    ray_over: dict,
) -> None:
    """Engine 0 and reward worker 0 misbehave on their 2nd call (step 2): each is restarted, the engine gets the
    learner's adapter again (probed and verified), the call is retried, and the run ends normally with every
    step done once."""
    from visionrl.orchestrate.loop import train

    fired = inject(*faults)
    result = train(_cfg(tiny_model, color_data, tmp_path / "run", ray=ray_over))
    for fault in faults:
        assert (fired / f"{fault}.fired").is_file(), f"{fault} never fired: the test tests nothing"
    history = _history(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2, 3] and result.steps == 3
    assert [h["faults/actor_restarts"] for h in history] == [0.0, 2.0, 2.0]
    # Step 2 sampled with the adapter of step 1 (re-synced to the restarted engine), and the learner agrees
    # with the engine's log-probs of it: the engine serves the policy being trained.
    assert [h["rollout/adapter_version"] for h in history] == [0.0, 1.0, 2.0]
    assert all(h["rollout/logprob_diff"] < 1e-3 for h in history)
    log = (tmp_path / "run" / "visionrl.log").read_text()
    assert "restarting the rollout engine 0 (restart 1 of ray.max_actor_restarts=3)" in log
    assert "restarting the reward worker 0 (restart 2 of ray.max_actor_restarts=3)" in log
    stuck = (
        "did not answer within 10 s during rollout"
        if "freeze_engine" in faults
        else ("reward worker 0 did not answer within 14 s during reward")
    )
    assert stuck in log


def test_an_engine_that_dies_while_collecting_the_next_batch_is_restarted_and_the_batch_collected(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, inject
) -> None:
    """rollout.async_steps=1: engine 0's 2nd generate call is step 2's batch, collected in the background while
    the learner trains step 1. The engine dies there; the collecting thread restarts it and gives it the
    learner's adapter (the version before or after that update, whichever the learner answers with first),
    and the batch is retried. Every sequence is labelled with the version that sampled it: the guard agrees
    with the engine, and the run ends normally with every step done once."""
    from visionrl.orchestrate.loop import train

    fired = inject("kill_engine")
    over = {"rollout": {"async_steps": 1}, "logging": {"save_every": 100}, "train": {"steps": 3}}
    result = train(_cfg(tiny_model, color_data, tmp_path / "run", **over))
    assert (fired / "kill_engine.fired").is_file(), "kill_engine never fired: the test tests nothing"
    history = _history(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2, 3] and result.steps == 3
    # the restart happened during step 1 (its prefetch), which is logged after the batch in flight arrived
    assert [h["faults/actor_restarts"] for h in history] == [1.0, 1.0, 1.0]
    assert history[1]["rollout/adapter_version"] in (0.0, 1.0)  # re-synced before or after step 1's update
    assert all(0.0 <= h["rollout/staleness"] <= 1.0 for h in history)
    assert all(h["rollout/logprob_diff"] < 1e-3 for h in history), [
        h["rollout/logprob_diff"] for h in history
    ]
    log = (tmp_path / "run" / "visionrl.log").read_text()
    assert "restarting the rollout engine 0 (restart 1 of ray.max_actor_restarts=3)" in log
    assert "rollout engine 0 serves adapter version" in log and "again (verified)" in log


def test_restarts_used_before_a_resume_count_against_the_limit(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, inject, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ray.max_actor_restarts bounds the whole run, resumes included. Run 1 (2 steps, limit 1): engine 0 dies on
    its 2nd generate call (step 2) and is restarted, 1 of 1 used, recorded in step 2's checkpoint. The resumed run
    (4 steps) starts with 1 used; its engine dies on its own 2nd call (step 4) and the run stops there. (With
    the count back at 0 after the resume, as before, it would restart the engine and finish.)"""
    from visionrl.checkpoint import latest_checkpoint, load_checkpoint
    from visionrl.orchestrate.loop import train

    run = tmp_path / "run"
    inject("kill_engine")
    train(_cfg(tiny_model, color_data, run, train={"steps": 2}, ray={"max_actor_restarts": 1}))
    assert [h["faults/actor_restarts"] for h in _history(run)] == [0.0, 1.0]
    assert load_checkpoint(latest_checkpoint(run)).extra["actor_restarts"] == 1

    again = tmp_path / "faults-resumed"  # the fault fires once per folder: arm it again for the resumed run
    again.mkdir()
    monkeypatch.setenv("VISIONRL_FAULTS_DIR", str(again))
    with pytest.raises(RunError) as err:
        train(
            _cfg(tiny_model, color_data, run, train={"steps": 4}, ray={"max_actor_restarts": 1}), resume=True
        )
    assert (again / "kill_engine.fired").is_file(), "the engine never died in the resumed run"
    text = str(err.value)
    assert text.startswith("the rollout engine 0 died during rollout"), text
    assert "(restarted 1 of ray.max_actor_restarts=1 times)" in text
    history = _history(run)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert [h["faults/actor_restarts"] for h in history] == [0.0, 1.0, 1.0]  # step 3 counts run 1's restart
    assert "actor restarts used: 1 of ray.max_actor_restarts=1" in (run / "visionrl.log").read_text()


@pytest.mark.parametrize("num_learners", [1, 2])
def test_a_dead_learner_stops_the_run_with_the_checkpoint_hint(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, inject, num_learners: int
) -> None:
    """The learner holds the optimizer state: it is never restarted, the run stops at once (restarts left).
    With 2 ranks, rank 0 dies and rank 1 fails in the next collective: the dead rank is the one named."""
    from visionrl.orchestrate.loop import train

    inject("kill_learner")
    with pytest.raises(RunError) as err:
        train(_cfg(tiny_model, color_data, tmp_path / "run", ray={"num_learners": num_learners}))
    text = str(err.value)
    assert text.startswith("the learner 0 died during update"), text
    assert "step_1" in text and "--resume" in text


def test_an_error_vllm_raises_is_shown_with_its_cause_and_the_traceback_logged(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """vLLM refuses the engine's settings (a context longer than the model's): its own validation error reaches the
    user with the engine and the phase, not Ray's `ray::RolloutActor...` wrapper; the traceback is in the run's
    log. (Prompts too long for the context are dropped at load now, before any engine: tests/data/test_lengths.py.)"""
    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model, color_data, tmp_path / "run", rollout={"engine": "vllm", "max_model_len": 10_000_000}
    )
    with pytest.raises(RunError) as err:
        train(cfg)
    lines = str(err.value).splitlines()
    assert lines[0].startswith("the rollout engine 0 failed during "), lines[0]
    assert "max_model_len" in lines[0] and "ray::" not in lines[0] and "pid=" not in lines[0]
    assert f"The full traceback is in {tmp_path / 'run' / 'visionrl.log'}." in lines
    log = (tmp_path / "run" / "visionrl.log").read_text()
    assert "rollout engine 0 failed during" in log and "its traceback:" in log
    assert "\x1b[" not in log and "site-packages/vllm/" in log  # vLLM's own frames, Ray's colours stripped


USER_REWARDS = textwrap.dedent(
    """
    import os
    import time

    def slow_once(completion, answer, record, marker=""):
        try:  # the first call of the run, in whichever process or thread, takes 5 s; the others none
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return 1.0
        time.sleep(5)
        return 1.0
    """
)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_reward_past_its_timeout_scores_zero_and_the_run_goes_on(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, isolation: str
) -> None:
    """One call of a reward runs 5 s past its 0.5 s timeout, in either runner chosen in the job file: it scores
    0 and is counted, the other 7 of the step and all of the next score 1 (the thread runner used to hang when
    the last call to settle was a timeout)."""
    from visionrl.orchestrate.loop import train

    (shared_ray.modules / "slow_rewards.py").write_text(
        USER_REWARDS
    )  # importable here and in the Ray workers
    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        train={"steps": 2},
        ray={"reward_timeout_s": 0.5, "reward_isolation": isolation},
    )
    marker = {"marker": str(tmp_path / "slow-once")}
    slow = cfg.rewards[0].model_copy(update={"name": "slow_rewards:slow_once", "kwargs": marker})
    result = train(cfg.model_copy(update={"rewards": [slow]}))
    assert [h["reward/timeouts"] for h in result.history] == [1.0, 0.0]
    assert [h["reward/errors"] for h in result.history] == [0.0, 0.0]
    assert [h["reward/mean"] for h in result.history] == [7 / 8, 1.0]  # 2 prompts x 4 completions a step


def test_without_restarts_a_dead_engine_stops_the_run_naming_it(
    tiny_model: Path, color_data: Path, tmp_path: Path, inject
) -> None:
    import ray

    from visionrl.orchestrate.loop import train

    inject("kill_engine")
    with pytest.raises(RunError) as err:
        train(_cfg(tiny_model, color_data, tmp_path / "run", ray={"max_actor_restarts": 0}))
    text = str(err.value)
    assert text.startswith("the rollout engine 0 died during rollout")
    assert "(restarted 0 of ray.max_actor_restarts=0 times)" in text
    assert "the newest checkpoint is" in text and "step_1" in text and "--resume" in text
    assert "ray::" not in text.splitlines()[0]
    assert not ray.is_initialized()
    assert [h["step"] for h in _history(tmp_path / "run")] == [1]
