"""MLflow through its own client (`mlflow.MlflowClient`): one MLflow run per visionrl run, continued on resume.

Scalars go under the TensorBoard tags (characters MLflow refuses become "_"), the rollout picture grid as an image
of the step (MLflow's `log_image` with a step), the rollout table as a Markdown artifact of each step, the job
config as the run's parameters and `config.yaml`. MLflow has no histogram: the step's histograms are summarised as
`<tag>/p10`, `/p50` and `/p90`. Without `tracking_uri` (or MLFLOW_TRACKING_URI) the run is kept in a database
in `<output_dir>/mlflow/` (`mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow/mlflow.db`)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from PIL import Image

from visionrl.errors import InputError
from visionrl.pictures import RolloutSample, samples_markdown
from visionrl.run_layout import RunDir

if TYPE_CHECKING:
    from visionrl.config import JobConfig

# A tracking server that does not answer must not hold a step for minutes (MLflow's defaults: 7 retries with
# backoff, 120 s per request); a user's own setting wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
MAX_PARAMS_PER_CALL = 100  # MLflow's limit on the parameters of one log_batch
MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter's value
_REFUSED = re.compile(r"[^A-Za-z0-9_\-. :/]")  # MLflow keys: letters, digits, _ - . space : /


def metric_key(tag: str) -> str:
    """`tag` as an MLflow metric key (the characters MLflow refuses replaced by "_")."""
    return _REFUSED.sub("_", tag)


def flat_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow parameters: dotted keys, lists as YAML flow text, values cut to MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
            out[metric_key(name)] = text.removesuffix("\n...")[:MAX_PARAM_CHARS]
    return out


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client: Any, run_id: str, tracking_uri: str) -> None:
        self.client, self.run_id, self.tracking_uri = client, run_id, tracking_uri
        self.identity = {"run_id": run_id, "tracking_uri": tracking_uri}

    @classmethod
    def open(cls, cfg: JobConfig, run: RunDir, earlier: Mapping[str, Any] | None) -> MlflowTracker:
        """The MLflow run of this visionrl run: `earlier`'s (a resume) or a new one, with the config logged."""
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        settings = cfg.logging.mlflow
        local = run.mlflow.resolve()
        uri = (
            settings.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{local / 'mlflow.db'}"
        )
        if uri.startswith("sqlite:///"):
            local.mkdir(parents=True, exist_ok=True)
        try:
            client = MlflowClient(tracking_uri=uri)
            if earlier and earlier.get("tracking_uri") == uri:
                tracker = cls(client, str(earlier["run_id"]), uri)
                client.update_run(tracker.run_id, status="RUNNING")
                client.log_text(tracker.run_id, _config_text(cfg), f"config/resumed_{int(time.time())}.yaml")
                return tracker
            experiment = client.get_experiment_by_name(settings.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                where = (local / "artifacts").as_uri() if uri.startswith("sqlite:///") else None
                experiment_id = client.create_experiment(settings.experiment, artifact_location=where)
            name = settings.run_name or run.root.resolve().name
            created = client.create_run(
                experiment_id, run_name=name, tags={"visionrl.output_dir": str(run.root)}
            )
            tracker = cls(client, created.info.run_id, uri)
            tracker._log_config(cfg)
            return tracker
        except MlflowException as err:
            raise InputError(
                f"MLflow at {uri} refused or did not answer: {err.message.splitlines()[0]}. Check "
                "logging.mlflow.tracking_uri (or MLFLOW_TRACKING_URI), or remove mlflow from logging.trackers"
            ) from None

    def _log_config(self, cfg: JobConfig) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), MAX_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + MAX_PARAMS_PER_CALL])
        self.client.log_text(self.run_id, _config_text(cfg), "config.yaml")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(tag), value, now, step) for tag, value in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit on the metrics of one log_batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def histogram(self, step: int, tag: str, values: np.ndarray) -> None:
        p10, p50, p90 = np.percentile(values, [10, 50, 90])
        self.scalars(step, {f"{tag}/p10": float(p10), f"{tag}/p50": float(p50), f"{tag}/p90": float(p90)})

    def image(self, step: int, tag: str, picture: Image.Image) -> None:
        self.client.log_image(self.run_id, picture.convert("RGB"), key=metric_key(tag), step=step)

    def rollout_table(self, step: int, samples: Sequence[RolloutSample]) -> None:
        self.client.log_text(self.run_id, samples_markdown(samples), f"rollouts/step_{step:06d}.md")

    def flush(self) -> None:
        """Each call above is sent when made: nothing is buffered."""

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status.upper())


def _config_text(cfg: JobConfig) -> str:
    from visionrl.config import dump_config

    return dump_config(cfg)
