"""Experiment trackers: where a run's scalars, histograms, rollout pictures and rollout tables go
(`logging.trackers`): TensorBoard (`metrics.MetricsWriter`, the default), MLflow and W&B, each through its own
client and under the same tags. `RunTrackers` sends every write to each of them; a tracker that fails mid-run
(a tracking server gone) is dropped with a warning, never the step: the history and the other trackers keep every
step. A resumed run continues the same MLflow and W&B runs (their ids are kept in `<output_dir>/trackers.json`)."""

from visionrl.trackers.fanout import RunTrackers, Tracker, open_trackers

__all__ = ["RunTrackers", "Tracker", "open_trackers"]
