"""Faults a long run meets, injected into real runs (Ray actors, the HF or vLLM engine, the tiny Qwen3-VL):
non-finite updates, a reward failing on every sample, an evaluation that fails, a torn history line and a
resume that must not duplicate TensorBoard steps. Each test is a row of docs/RELIABILITY.md."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from small_job import small_job, write_job

from visionrl.checkpoint import latest_checkpoint, load_checkpoint
from visionrl.cli import main
from visionrl.errors import RunError
from visionrl.metrics import SKIPPED_UPDATES, read_scalars

pytestmark = pytest.mark.slow


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]


def test_nonfinite_updates_are_never_applied_and_the_run_ends_non_zero(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Every update NaN (fault `nonfinite_loss`, inside the learner actor): with `skip` each is counted in
    faults/skipped_updates and not applied, the checkpoints hold the untouched initial adapter, and since no
    update was ever applied the run exits 1 with the first errors and exports nothing. With `stop` the first
    NaN ends the run, before any checkpoint."""
    monkeypatch.setenv("VISIONRL_FAULTS", "nonfinite_loss")  # the run's actors get it (faults.actor_env)
    run = tmp_path / "skip"
    cfg = small_job(tiny_model, color_data, run, train={"steps": 2, "max_consecutive_skips": 3})
    assert main(["train", write_job(cfg, tmp_path / "skip.yaml")]) == 1
    err = capsys.readouterr().err
    assert "every learner update of the run (2) was skipped as non-finite" in err
    assert "step 1: all 1 learner update(s) skipped: loss nan, gradient norm nan" in err
    steps = _steps(run)
    assert [s[SKIPPED_UPDATES] for s in steps] == [1.0, 1.0]
    assert [s["rollout/adapter_version"] for s in steps] == [0.0, 0.0]  # the engine never got a NaN version
    assert [v for _, v in read_scalars(run / "tensorboard")[SKIPPED_UPDATES]] == [1.0, 1.0]
    ckpt = load_checkpoint(latest_checkpoint(run))
    assert ckpt.step == 2
    from safetensors.numpy import load_file

    weights = load_file(str(ckpt.adapter_dir / "adapter_model.safetensors"))
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and all((v == 0).all() for v in lora_b)  # peft's initial B = 0: no NaN step was applied
    assert not (run / "adapter").exists()  # nothing exported as the run's adapter

    stopped = tmp_path / "stop"
    cfg = small_job(tiny_model, color_data, stopped, train={"steps": 3, "on_nonfinite": "stop"})
    with pytest.raises(RunError, match=r"(?s)NonFiniteError: a learner update had a non-finite loss \(nan\).*"
                       r"no checkpoint was written yet"):  # fmt: skip
        from visionrl.orchestrate.loop import train

        train(cfg)
    assert latest_checkpoint(stopped) is None


def test_torn_history_is_dropped_on_resume_and_tensorboard_has_no_duplicate_steps(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed after logging step 3 but before its checkpoint, in the middle of appending step 4's line:
    `--resume` drops the torn line (and says so), re-runs steps 3 and 4, and TensorBoard's own reader shows
    every step once, with the new values."""
    from visionrl.orchestrate.loop import train

    run = tmp_path / "run"
    train(small_job(tiny_model, color_data, run, train={"steps": 3}, logging={"save_every": 2}))
    load_checkpoint(run / "checkpoints" / "step_3")  # the final save of step 3: removed below, as if killed
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_3")
    with (run / "history.jsonl").open("a") as f:
        f.write('{"step": 4, "reward/me')  # torn: no newline, half a record
    first = read_scalars(run / "tensorboard")["reward/mean"]
    assert [s for s, _ in first] == [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="visionrl.history"):
        resumed = train(
            small_job(tiny_model, color_data, run, train={"steps": 4}, logging={"save_every": 2}), resume=True
        )
    assert "dropped its torn last line 4" in caplog.text
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert [s["step"] for s in _steps(run)] == [1, 2, 3, 4]
    scalars = read_scalars(run / "tensorboard")
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3, 4]
    assert scalars["reward/mean"][2][1] == pytest.approx(
        resumed.history[0]["reward/mean"]
    )  # the re-run's value
    assert scalars["reward/mean"][:2] == first[:2]


def test_a_reward_failing_on_every_sample_stops_the_run_with_its_error(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray
) -> None:
    """A user reward that raises on every call: after train.max_consecutive_skips such steps the run stops with
    the reward's own exception message (before: it trained on zeros and exited 0)."""
    from visionrl.orchestrate.loop import train

    (shared_ray.modules / "broken_reward_vr.py").write_text(  # importable here and in the Ray workers
        "def score(completion, answer, record):\n    raise KeyError('field bbox missing in record')\n"
    )
    cfg = small_job(tiny_model, color_data, tmp_path / "run", rewards=[{"name": "broken_reward_vr:score"}],
               train={"steps": 5, "max_consecutive_skips": 2})  # fmt: skip
    with pytest.raises(RunError) as err:
        train(cfg)
    text = str(err.value)
    assert text.startswith("2 steps in a row without a usable update (train.max_consecutive_skips=2)")
    assert "step 1: reward 'broken_reward_vr:score' failed on all 8 samples: KeyError" in text
    assert "field bbox missing in record" in text
    assert len(_steps(tmp_path / "run")) == 1  # step 2 stopped the run before its record


def test_a_failed_evaluation_still_checkpoints_its_step_and_cleans_up(
    tiny_model: Path, color_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vLLM engine dies during the evaluation of step 2: the run stops with the cause, but step 2 (not a
    save step) is logged and checkpointed first, so `--resume` gets past it; the engine's adapter copies in its
    scratch folder (hundreds of MB at 8B) are removed although it never closed."""
    import ray

    from visionrl.orchestrate import workers
    from visionrl.orchestrate.loop import train
    from visionrl.rollout.scratch import PREFIX, process_alive, scratch_root

    real = workers.Workers.evaluate

    def engine_dies(self, prompts):
        ray.kill(self.engines[0])
        return real(self, prompts)

    monkeypatch.setattr(workers.Workers, "evaluate", engine_dies)
    before = set(scratch_root().glob(f"{PREFIX}*"))
    run = tmp_path / "run"
    cfg = small_job(tiny_model, color_data, run, rollout={"engine": "vllm"},
               data={"eval": str(color_data / "eval.jsonl"), "max_eval_samples": 4},
               train={"steps": 4}, logging={"eval_every": 2, "save_every": 100})  # fmt: skip
    with pytest.raises(
        RunError,
        match=r"(?s)the evaluation at step 2 failed: \w*(ActorDied|RayActor|ActorFailed)\w*: .*step 2 was checkpointed",
    ):
        train(cfg)
    assert load_checkpoint(latest_checkpoint(run)).step == 2
    assert [s["step"] for s in _steps(run)] == [1, 2]
    left = set(scratch_root().glob(f"{PREFIX}*")) - before
    # the run's engines are gone, and so are their folders; a live owner is another test process's engine
    assert {d for d in left if not process_alive(int(d.name[len(PREFIX) :].split("-", 1)[0]))} == set()
