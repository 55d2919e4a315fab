"""The names inside a run directory (`output_dir` of a job), defined once for every module that reads or
writes them: the loop, checkpoints, export, evaluation and the demo.

    <output_dir>/
      config.yaml          the resolved job config
      history.jsonl        one line of metrics per step (appended every step)
      visionrl.log         the run's log lines and the full tracebacks of failed actors (appended)
      libraries.log        what the libraries wrote (vLLM, Ray, transformers, torch), unless --verbose (appended)
      tensorboard/         event files
      trackers.json        the MLflow / W&B runs this run writes to (a resumed run continues them)
      mlflow/              MLflow's database and artifacts, when no tracking server is set
      wandb/               W&B's offline runs
      checkpoints/step_N/  atomic checkpoints (see visionrl.checkpoint)
      adapter/             the final PEFT adapter with visionrl_manifest.json
      eval/*.json          evaluation reports (+ .md twins)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RUN_CONFIG = "config.yaml"
HISTORY = "history.jsonl"
RUN_LOG = "visionrl.log"
LIBRARIES_LOG = "libraries.log"
TENSORBOARD_DIR = "tensorboard"
TRACKERS = "trackers.json"
MLFLOW_DIR = "mlflow"
CHECKPOINTS_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
EVAL_DIR = "eval"
FINAL_EVAL = "final.json"  # the report of the final adapter, under EVAL_DIR (the manifest records it)
STEP_PREFIX = "step_"


def step_dir_name(step: int) -> str:
    """`step_N`: the name of the checkpoint of step N."""
    return f"{STEP_PREFIX}{step}"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory."""

    root: Path

    @classmethod
    def of(cls, output_dir: str | os.PathLike[str]) -> RunDir:
        return cls(Path(output_dir))

    @property
    def config(self) -> Path:
        return self.root / RUN_CONFIG

    @property
    def history(self) -> Path:
        return self.root / HISTORY

    @property
    def log(self) -> Path:
        return self.root / RUN_LOG

    @property
    def libraries_log(self) -> Path:
        return self.root / LIBRARIES_LOG

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD_DIR

    @property
    def trackers(self) -> Path:
        return self.root / TRACKERS

    @property
    def mlflow(self) -> Path:
        return self.root / MLFLOW_DIR

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def adapter(self) -> Path:
        return self.root / ADAPTER_DIR

    @property
    def eval(self) -> Path:
        return self.root / EVAL_DIR

    @property
    def final_eval(self) -> Path:
        return self.eval / FINAL_EVAL
