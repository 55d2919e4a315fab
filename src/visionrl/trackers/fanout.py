"""`RunTrackers`: one run's writes sent to every tracker of `logging.trackers`, and the ids that let a resumed run
continue the same tracked runs."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from PIL import Image

from visionrl import metrics as tags
from visionrl.errors import InputError, Preempted
from visionrl.files import atomic_write
from visionrl.metrics import MetricsWriter
from visionrl.pictures import RolloutSample, rollout_grid
from visionrl.run_layout import RunDir

if TYPE_CHECKING:
    import torch

    from visionrl.config import JobConfig

logger = logging.getLogger(__name__)


class Tracker(Protocol):
    """A tracker beside TensorBoard: what `RunTrackers` calls (values already finite, pictures already drawn)."""

    name: str

    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...
    def histogram(self, step: int, tag: str, values: np.ndarray) -> None: ...
    def image(self, step: int, tag: str, picture: Image.Image) -> None: ...
    def rollout_table(self, step: int, samples: Sequence[RolloutSample]) -> None: ...
    def flush(self) -> None: ...
    def close(self, status: str) -> None: ...  # status: finished | failed | killed


def open_trackers(cfg: JobConfig, run: RunDir, resumed: bool) -> RunTrackers:
    """The trackers of `cfg.logging.trackers`, opened: on a resumed run (`resumed`) the MLflow and W&B runs of
    `<output_dir>/trackers.json` continue; otherwise new ones start and their ids are written there."""
    names = cfg.logging.trackers
    ids = _read_ids(run.trackers) if resumed else {}
    tb = MetricsWriter(run.tensorboard) if "tensorboard" in names else None
    extra: list[Tracker] = []
    try:
        if "mlflow" in names:
            from visionrl.trackers.mlflow_run import MlflowTracker

            extra.append(MlflowTracker.open(cfg, run, ids.get("mlflow")))
        if "wandb" in names:
            from visionrl.trackers.wandb_run import WandbTracker

            extra.append(WandbTracker.open(cfg, run, ids.get("wandb")))
    except BaseException:
        for tracker in extra:
            tracker.close("failed")
        if tb is not None:
            tb.close()
        raise
    found = {t.name: getattr(t, "identity", None) for t in extra}
    if found:
        atomic_write(run.trackers, json.dumps(found, indent=2) + "\n")
    return RunTrackers(tb, extra)


def _read_ids(path: Path) -> dict[str, Any]:
    """The tracked runs a resumed run continues ({} when none was recorded, e.g. the run used TensorBoard only)."""
    if not path.exists():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(
            f"{path} cannot be read ({err}): it names the MLflow/W&B runs this run continues; delete it to start "
            "new tracked runs"
        ) from None
    return ids if isinstance(ids, dict) else {}


class RunTrackers:
    """The writer the loop uses: TensorBoard's (when listed) and each other tracker's, called in turn.

    TensorBoard failing (a full disk) raises `StorageError` as before. Another tracker raising is dropped for the
    rest of the run with one warning naming it, the step and the error (`dropped`)."""

    def __init__(self, tb: MetricsWriter | None, extra: Sequence[Tracker]) -> None:
        self.tb = tb
        self.extra = list(extra)
        self.dropped: dict[str, str] = {}  # tracker name -> why it stopped receiving
        self.step = 0  # the step last written (named when a tracker is dropped)

    def _each(self, step: int, call: Callable[[Tracker], None]) -> None:
        self.step = max(self.step, step)
        for tracker in list(self.extra):
            try:
                call(tracker)
            except Exception as err:  # a tracker is a mirror: losing it must not stop the run
                self.extra.remove(tracker)
                why = f"{type(err).__name__}: {err}"
                self.dropped[tracker.name] = f"step {step}: {why}"
                logger.warning(
                    "%s stopped receiving this run's metrics at step %d (%s); the run goes on, and history.jsonl "
                    "and the other trackers have every step",
                    tracker.name,
                    step,
                    why,
                )
                _close_quietly(tracker, "failed")

    def purge_from(self, step: int) -> None:
        """A resumed run re-runs `step` and later: TensorBoard hides their earlier values. MLflow and W&B cannot
        hide a value, so they show both for those steps (docs/RELIABILITY.md)."""
        if self.tb is not None:
            self.tb.purge_from(step)

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        if self.tb is not None:
            self.tb.scalars(step, values)
        measured = {tag: float(v) for tag, v in values.items() if v is not None}
        self._each(step, lambda t: t.scalars(step, measured))

    def histogram(self, step: int, tag: str, values: Sequence[float] | np.ndarray | torch.Tensor) -> None:
        if hasattr(values, "detach"):  # a torch tensor, possibly on an accelerator
            values = values.detach().cpu().numpy()
        array = np.asarray(values, dtype=np.float64).ravel()
        if self.tb is not None:
            self.tb.histogram(step, tag, array)
        finite = array[np.isfinite(array)]
        if finite.size:
            self._each(step, lambda t: t.histogram(step, tag, finite))

    def rollout_images(self, step: int, samples: Sequence[RolloutSample]) -> bool:
        """The picture grid of `samples` under SAMPLES_IMAGE in every tracker; False when it could not be drawn (an
        unreadable image: warned, skipped)."""
        grid = rollout_grid(step, samples)
        if grid is None:
            return False
        if self.tb is not None:
            self.tb.image(step, tags.SAMPLES_IMAGE, grid)
        self._each(step, lambda t: t.image(step, tags.SAMPLES_IMAGE, grid))
        return True

    def rollout_table(self, step: int, samples: Sequence[RolloutSample]) -> None:
        if not samples:
            return
        if self.tb is not None:
            self.tb.rollout_table(step, samples)
        self._each(step, lambda t: t.rollout_table(step, samples))

    def flush(self) -> None:
        if self.tb is not None:
            self.tb.flush()
        self._each(self.step, lambda t: t.flush())

    def close(self, status: str = "finished") -> None:
        for tracker in self.extra:
            _close_quietly(tracker, status)
        self.extra = []
        if self.tb is not None:
            self.tb.close()

    def __enter__(self) -> RunTrackers:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is None:
            self.close("finished")
        else:
            stopped = issubclass(kind, Preempted | KeyboardInterrupt)  # a stop signal: the run resumes later
            self.close("killed" if stopped else "failed")


def _close_quietly(tracker: Tracker, status: str) -> None:
    try:
        tracker.close(status)
    except Exception as err:  # closing a tracker whose server is gone: nothing more to lose
        logger.warning("%s could not be closed: %s: %s", tracker.name, type(err).__name__, err)
