"""W&B through its own client (`wandb.init`): one W&B run per visionrl run, continued on resume (same run id).

Scalars and histograms go under the TensorBoard tags, plotted against `step` (the run's step, so a resumed run's
re-run steps are accepted: W&B refuses a step lower than its own counter); the rollout picture grid as an image and
the rollout table as a W&B table with each prompt's image. `mode: offline` (the default) writes under
`<output_dir>/wandb/` without an account; `wandb sync <output_dir>/wandb/offline-run-*` uploads it later."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from visionrl import metrics as tags
from visionrl.errors import InputError
from visionrl.pictures import RolloutSample, truncate
from visionrl.run_layout import RunDir

if TYPE_CHECKING:
    from visionrl.config import JobConfig

STEP_KEY = "step"  # the x-axis of every chart
THUMBNAIL = 256  # px: the longer side of a prompt image in the rollout table
TABLE_CHARS = 2000  # a completion in the rollout table is cut to this many characters
EXIT_CODES = {"finished": 0, "failed": 1, "killed": 143}


class WandbTracker:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self.identity = {"id": run.id}

    @classmethod
    def open(cls, cfg: JobConfig, run_dir: RunDir, earlier: Mapping[str, Any] | None) -> WandbTracker:
        """The W&B run of this visionrl run: `earlier`'s id (a resume) or a new one, with the config."""
        import wandb

        settings = cfg.logging.wandb
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_id = str(earlier["id"]) if earlier and earlier.get("id") else None
        try:
            run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.run_name or run_dir.root.resolve().name,
                dir=str(run_dir.root),
                mode=settings.mode,
                config=cfg.model_dump(mode="json"),
                settings=wandb.Settings(console="off", silent=True),
                id=run_id,
                resume="allow" if run_id else None,
            )
        except (wandb.errors.Error, OSError) as err:
            raise InputError(
                f"W&B could not start a run ({type(err).__name__}: {err}). For mode: online, log in first "
                "(`wandb login` or WANDB_API_KEY); mode: offline needs no account; or remove wandb from "
                "logging.trackers"
            ) from None
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        return cls(run)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({STEP_KEY: step, **values})

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        import wandb

        self.run.log({STEP_KEY: step, tag: wandb.Histogram(values)})

    def image(self, step: int, tag: str, picture: Image.Image) -> None:
        import wandb

        self.run.log({STEP_KEY: step, tag: wandb.Image(picture.convert("RGB"))})

    def rollout_table(self, step: int, samples: Sequence[RolloutSample]) -> None:
        """The rollouts as a table: the prompt's image, question, completion, answer, reward (and the judge's
        verdict when a judge scored them)."""
        import wandb

        judged = any(s.verdict for s in samples)
        columns = ["image", "question", "completion", "answer", "reward"] + (["judge"] if judged else [])
        table = wandb.Table(columns=columns)
        for s in samples:
            thumb = s.image.convert("RGB")
            thumb.thumbnail((THUMBNAIL, THUMBNAIL))
            row = [wandb.Image(thumb), s.question, truncate(s.completion, TABLE_CHARS), s.answer, s.reward]
            table.add_data(*row, *([s.verdict] if judged else []))
        self.run.log({STEP_KEY: step, tags.SAMPLES_TABLE: table})

    def flush(self) -> None:
        """W&B writes in its own process as each call is made."""

    def close(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))
