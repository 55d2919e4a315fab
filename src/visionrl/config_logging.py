"""The `logging:` section of a job: how often a run writes its scalars, pictures, evaluations and checkpoints, and
the experiment trackers that receive them (TensorBoard always by default; MLflow and W&B when listed)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from visionrl.config_yaml import Section

Tracker = Literal["tensorboard", "mlflow", "wandb"]
# the package a tracker needs, and what to install (pyproject's `trackers` extra holds both)
TRACKER_PACKAGES = {"mlflow": ("mlflow", "mlflow-skinny"), "wandb": ("wandb", "wandb")}


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None,
        description="An MLflow tracking server (http://host:5000), a database (sqlite:///path.db) or "
        "'databricks'; default: MLFLOW_TRACKING_URI, else a database in <output_dir>/mlflow/.",
    )
    experiment: str = Field("visionrl", min_length=1, description="MLflow experiment (created if missing).")
    run_name: str | None = Field(None, description="MLflow run name; default: output_dir's folder name.")


class WandbConfig(Section):
    project: str = Field("visionrl", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user; default: your W&B default entity.")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: written under <output_dir>/wandb/ (upload later with `wandb sync`); online: "
        "sent as the run goes (needs `wandb login` or WANDB_API_KEY).",
    )
    run_name: str | None = Field(None, description="W&B run name; default: output_dir's folder name.")


class LoggingConfig(Section):
    log_every: int = Field(1, ge=1, description="Scalars every N steps.")
    eval_every: int = Field(10, ge=1, description="Held-out evaluation every N steps (and at the end).")
    save_every: int = Field(50, ge=1, description="Checkpoint every N steps (and at the end).")
    images_every: int = Field(10, ge=1, description="Rollout picture grid in TensorBoard every N steps.")
    num_images: int = Field(4, ge=1, le=32, description="Rollouts per picture grid.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest removed first).")
    trackers: list[Tracker] = Field(
        default_factory=lambda: list[Tracker](["tensorboard"]),
        min_length=1,
        description="Where the scalars, histograms, pictures and rollout tables go: any of tensorboard "
        "(<output_dir>/tensorboard/), mlflow, wandb (pip install 'visionrl[trackers]').",
    )
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("trackers")
    @classmethod
    def validate_trackers(cls, trackers: list[str]) -> list[str]:
        if len(set(trackers)) < len(trackers):
            raise ValueError(f"logging.trackers names a tracker twice: {trackers}; list each once")
        for name in trackers:
            module, install = TRACKER_PACKAGES.get(name, (None, None))
            if module is not None and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"logging.trackers names {name}, which is not installed here: "
                    f"pip install 'visionrl[trackers]' (or {install}), or remove {name} from the list"
                )
        return trackers
