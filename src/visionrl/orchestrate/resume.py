"""Which checkpoint a run continues from (`resume`: false | true | auto), and what a resume may change.

A checkpoint records the config it was trained with. On resume, settings that give the saved adapter and
optimizer state their shape (the base model, the LoRA layout) must be unchanged: a change is refused with
the old and new value. The optimizer settings (learning rates, betas, weight decay) are applied from the
job, and the change is logged; other changes (steps, logging, sampling) take effect with a note. The run's
`config.yaml` is then rewritten with what is used.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import yaml

from visionrl import history
from visionrl.checkpoint import MANIFEST, checkpoint_step, latest_checkpoint
from visionrl.config import JobConfig
from visionrl.errors import InputError
from visionrl.run_layout import STEP_PREFIX, RunDir

logger = logging.getLogger(__name__)

ResumeMode = bool | Literal["auto"]

# The saved adapter and optimizer state have this shape: a different value cannot be loaded.
REFUSED = (
    "model.path",
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "lora.train_merger",
    "lora.train_lm_head",
)
# The learner applies these after loading the optimizer state (train.learner_state.apply_optimizer_settings).
APPLIED = ("train.lr", "train.merger_lr", "train.lm_head_lr", "train.betas", "train.weight_decay")
IGNORED = ("resume",)  # how the run was started, not how it trains


def checkpoint_to_resume(cfg: JobConfig, run: RunDir, mode: ResumeMode) -> Path | None:
    """The checkpoint to continue from, or None to start fresh. Raises InputError where `mode` false meets
    checkpoints of an earlier run, or where the job changes what the checkpoint's shape depends on."""
    if mode is False:
        if run.checkpoints.is_dir() and any(run.checkpoints.glob(f"{STEP_PREFIX}*")):
            raise InputError(
                f"output_dir {run.root} holds checkpoints of an earlier run; continue it with `--resume` (or "
                "`--resume auto` / `resume: auto` in the job file, which also starts fresh when there are none), "
                "or set output_dir to a new directory (nothing was overwritten)"
            )
        return None
    path = latest_checkpoint(run.root)
    if path is None:
        how = "auto: starting fresh" if mode == "auto" else "starting from step 0"
        logger.warning("resume %s: no complete checkpoint in %s", how, run.checkpoints)
        return None
    path = _with_every_step_recorded(run, path)
    check_changes(cfg, path, saved_config(path, run))
    return path


def _with_every_step_recorded(run: RunDir, path: Path) -> Path:
    """`path`, or an older checkpoint when history.jsonl lacks records up to `path`'s step (a torn or lost line):
    the newest at or before the last recorded step, so the unrecorded steps run again and are logged."""
    step, recorded = checkpoint_step(path), history.recorded_through(run.history)
    if recorded >= step or not run.history.is_file():
        return path
    older = latest_checkpoint(run.root, at_most=recorded)
    if older is None:
        logger.warning(
            "%s has no record of step(s) %d-%d and no checkpoint precedes them; continuing from step %d, so their "
            "metrics stay only in TensorBoard", run.history, recorded + 1, step, step,
        )  # fmt: skip
        return path
    logger.warning(
        "%s has no record of step(s) %d-%d (newest checkpoint: step %d); continuing from the checkpoint of step %d, "
        "so steps %d-%d run again and are recorded", run.history, recorded + 1, step, step,
        checkpoint_step(older), checkpoint_step(older) + 1, step,
    )  # fmt: skip
    return older


def saved_config(path: Path, run: RunDir) -> dict[str, Any] | None:
    """The config a checkpoint was trained with: recorded in it, or (older checkpoints) the run's config.yaml."""
    import json

    extra = json.loads((path / MANIFEST).read_text()).get("extra") or {}
    if isinstance(extra.get("config"), dict):
        return dict(extra["config"])
    if run.config.is_file():
        loaded = yaml.safe_load(run.config.read_text())
        return loaded if isinstance(loaded, dict) else None
    return None


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """key -> (checkpoint's value, job's value) for every setting that differs (lists and tuples alike)."""
    a, b = _flat(old), _flat(new)
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 (JSON has no tuples)
    return {
        k: (a.get(k), b.get(k))
        for k in sorted(a.keys() | b.keys())
        if k not in IGNORED and norm(a.get(k)) != norm(b.get(k))
    }


def check_changes(cfg: JobConfig, path: Path, old: dict[str, Any] | None) -> None:
    if old is None:
        logger.warning("checkpoint %s records no config: changes since it cannot be checked", path)
        return
    changes = changed_settings(old, cfg.model_dump(mode="json"))
    refused = {k: v for k, v in changes.items() if k in REFUSED}
    if refused:
        lines = "\n".join(f"  - {k}: {a!r} in the checkpoint, {b!r} now" for k, (a, b) in refused.items())
        raise InputError(
            f"cannot resume from {path}: the job changes settings the saved adapter and optimizer state depend "
            f"on:\n{lines}\nSet them back to the checkpoint's values, or start a new run in another output_dir"
        )
    for k, (a, b) in changes.items():
        if k in APPLIED:
            logger.warning("resume: %s changed from %r to %r: applied from the next step on", k, a, b)
        else:
            logger.info("resume: %s changed from %r to %r", k, a, b)
