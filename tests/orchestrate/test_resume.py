"""Which checkpoint a run continues from (`resume: false | true | auto`) and which changes a resume refuses,
applies or notes; checkpoints written here with the real save_checkpoint (no Ray, no model)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from visionrl.checkpoint import save_checkpoint
from visionrl.config import JobConfig, config_from_dict
from visionrl.errors import InputError
from visionrl.orchestrate.resume import changed_settings, checkpoint_to_resume
from visionrl.run_layout import RunDir


def _cfg(out: Path, **over: dict) -> JobConfig:
    raw: dict = {
        "output_dir": str(out),
        "model": {"path": "base"},
        "data": {"train": "train.jsonl"},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 16},
        "train": {"lr": 1e-3},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def _save(cfg: JobConfig, step: int) -> Path:
    return save_checkpoint(
        cfg.output_dir,
        step,
        adapter_files={"adapter_model.safetensors": save({"w": torch.zeros(2)})},
        trainer_state=b"state",
        sampler_state={"position": step},
        extra={"config": cfg.model_dump(mode="json")},
    )


def test_modes_without_and_with_checkpoints(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run")
    run = RunDir.of(cfg.output_dir)
    assert checkpoint_to_resume(cfg, run, False) is None  # fresh run, nothing there
    assert checkpoint_to_resume(cfg, run, "auto") is None  # auto: nothing to continue, start fresh
    assert checkpoint_to_resume(cfg, run, True) is None  # asked to resume, none there: from step 0, warned
    _save(cfg, 2)
    newest = _save(cfg, 4)
    assert checkpoint_to_resume(cfg, run, "auto") == newest
    assert checkpoint_to_resume(cfg, run, True) == newest
    with pytest.raises(InputError, match=r"holds checkpoints of an earlier run; continue it with `--resume`"):
        checkpoint_to_resume(cfg, run, False)


def test_a_step_missing_from_the_history_runs_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """history.jsonl without step 4's record (a torn last line) beside a checkpoint of step 4: the run continues
    from step 2's checkpoint, so steps 3 and 4 run again and every step has its record."""
    cfg = _cfg(tmp_path / "run")
    run = RunDir.of(cfg.output_dir)
    older, newest = _save(cfg, 2), _save(cfg, 4)
    lines = [f'{{"step": {i}, "reward/mean": 0.5}}' for i in (1, 2, 3)]
    run.history.write_text("\n".join(lines) + '\n{"step": 4, "rew')
    with caplog.at_level(logging.WARNING):
        assert checkpoint_to_resume(cfg, run, True) == older
    assert (
        "has no record of step(s) 4-4 (newest checkpoint: step 4); continuing from the checkpoint of step 2"
        in (caplog.text)
    )
    run.history.write_text("\n".join([*lines, '{"step": 4, "reward/mean": 0.5}']) + "\n")
    assert checkpoint_to_resume(cfg, run, True) == newest  # every step recorded: the newest
    run.history.write_text(lines[0] + "\n")  # steps 2-4 unrecorded, no checkpoint at or before step 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert checkpoint_to_resume(cfg, run, True) == newest
    assert "no checkpoint precedes them; continuing from step 4" in caplog.text


def test_a_change_of_the_adapter_shape_is_refused_with_both_values(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run")
    path = _save(cfg, 3)
    changed = _cfg(tmp_path / "run", lora={"rank": 8, "train_lm_head": True})
    with pytest.raises(InputError) as err:
        checkpoint_to_resume(changed, RunDir.of(cfg.output_dir), "auto")
    text = str(err.value)
    assert text.startswith(f"cannot resume from {path}: the job changes settings")
    assert "  - lora.rank: 16 in the checkpoint, 8 now" in text
    assert "  - lora.train_lm_head: False in the checkpoint, True now" in text
    assert "start a new run in another output_dir" in text


def test_optimizer_changes_are_applied_and_said_other_changes_noted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(tmp_path / "run")
    path = _save(cfg, 3)
    changed = _cfg(tmp_path / "run", train={"lr": 2e-3, "steps": 300, "betas": [0.9, 0.95]})
    with caplog.at_level(logging.INFO, logger="visionrl"):
        assert checkpoint_to_resume(changed, RunDir.of(cfg.output_dir), True) == path
    lines = {r.getMessage(): r.levelname for r in caplog.records}
    assert lines["resume: train.lr changed from 0.001 to 0.002: applied from the next step on"] == "WARNING"
    assert lines[
        "resume: train.betas changed from [0.9, 0.999] to [0.9, 0.95]: applied from the next step on"
    ]
    assert lines["resume: train.steps changed from 100 to 300"] == "INFO"


def test_changed_settings_compare_nested_keys_and_ignore_the_resume_mode() -> None:
    old = {"resume": False, "train": {"lr": 1.0, "betas": [0.9, 0.99]}, "rewards": [{"name": "a"}]}
    new = {"resume": "auto", "train": {"lr": 1.0, "betas": (0.9, 0.99)}, "rewards": [{"name": "b"}]}
    # tuples (pydantic) and lists (JSON) of equal values are equal; a list of sections compares as a whole
    assert changed_settings(old, new) == {"rewards": ([{"name": "a"}], [{"name": "b"}])}


def test_the_learner_applies_the_jobs_optimizer_settings_after_loading(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Loading optimizer state restores the saved rates (torch keeps them in the state): the learner then sets
    the job's. Constant schedule without warm-up: the factor is 1, so each group's rate is its base rate."""
    from visionrl.adapter.files import write_adapter_files
    from visionrl.train.learner import Learner

    def cfg(**train: object) -> JobConfig:
        return _cfg(
            tmp_path / "run",
            model={"path": str(tiny_model), "dtype": "float32"},
            lora={"rank": 4, "train_lm_head": True},
            train={"lr_schedule": "constant", "torch_threads": 1, **train},
        )

    saved = Learner(cfg(lr=1e-3), device="cpu")
    write_adapter_files(tmp_path / "adapter", saved.adapter_payload(for_engine=False).files)
    state = saved.state_dict()["trainer_state"]
    resumed = Learner(cfg(lr=2e-3, lm_head_lr=4e-3, betas=[0.8, 0.9], weight_decay=0.1), device="cpu")
    resumed.load_state(tmp_path / "adapter", state)
    groups = {g["name"]: g for g in resumed.optimizer.param_groups}
    assert (groups["lm"]["lr"], groups["lm_head"]["lr"]) == (2e-3, 4e-3)
    assert groups["lm"]["betas"] == (0.8, 0.9) and groups["lm_head"]["weight_decay"] == 0.1
