"""The experiment trackers (`logging.trackers`): TensorBoard, MLflow (its own client, a local database, and a real
`mlflow server` on 127.0.0.1) and W&B (offline) receive the same tags, steps, pictures and rollout tables; a resumed
run continues the same tracked runs; a tracker that fails mid-run is dropped and the run goes on."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tests.wandb_records import history, run_ids

from visionrl import metrics as tags
from visionrl.config import config_from_dict
from visionrl.config_yaml import ConfigError
from visionrl.errors import InputError
from visionrl.metrics import read_scalars, read_tags
from visionrl.pictures import RolloutSample
from visionrl.run_layout import RunDir
from visionrl.trackers import open_trackers

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


def _cfg(out: Path, trackers: list[str], **mlflow: Any) -> Any:
    return config_from_dict(
        {
            "output_dir": str(out),
            "model": {"path": "models/base"},
            "data": {"train": "data/train.jsonl"},
            "rewards": [{"name": "exact_match"}],
            "train": {"lr": 3e-4},
            "logging": {"trackers": trackers, "mlflow": mlflow},
        }
    )


def _samples() -> list[RolloutSample]:
    red, blue = Image.new("RGB", (24, 24), (255, 0, 0)), Image.new("RGB", (24, 24), (0, 0, 255))
    return [
        RolloutSample(red, "what colour?", "red", "red", 1.0),
        RolloutSample(blue, "what colour?", "green", "blue", 0.0),
    ]


def _write_steps(trackers: Any, steps: range) -> None:
    for step in steps:
        trackers.scalars(
            step, {tags.REWARD_MEAN: step / 10, tags.LOSS_POLICY: -step / 100, tags.LOSS_KL: None}
        )
        trackers.histogram(step, tags.REWARD_HIST, np.array([0.0, 1.0, 1.0, float("nan")]))
        assert trackers.rollout_images(step, _samples())
        trackers.rollout_table(step, _samples())
        trackers.flush()


def _mlflow_client(out: Path) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow' / 'mlflow.db').resolve()}")


def test_each_tracker_gets_the_same_tags_steps_pictures_and_tables(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(out, ["tensorboard", "mlflow", "wandb"])
    with open_trackers(cfg, RunDir.of(out), resumed=False) as trackers:
        _write_steps(trackers, range(1, 3))
    ids = json.loads((out / "trackers.json").read_text())
    # TensorBoard: as before
    scalars = read_scalars(out / "tensorboard")
    assert scalars[tags.REWARD_MEAN] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    assert tags.LOSS_KL not in scalars  # None: not measured, in no tracker
    assert tags.SAMPLES_IMAGE in read_tags(out / "tensorboard")["images"]
    # MLflow: the same scalar tags and steps, the picture of each step, the table, the config as parameters
    client = _mlflow_client(out)
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert set(run.data.metrics) == {tags.REWARD_MEAN, tags.LOSS_POLICY} | {
        f"{tags.REWARD_HIST}/p{p}" for p in (10, 50, 90)
    }
    history_ = client.get_metric_history(run.info.run_id, tags.REWARD_MEAN)
    assert [(m.step, m.value) for m in history_] == [(1, 0.1), (2, 0.2)]
    # the histogram's NaN left out: the median of [0, 1, 1] is 1
    assert client.get_metric_history(run.info.run_id, f"{tags.REWARD_HIST}/p50")[0].value == 1.0
    assert run.data.params["train.lr"] == "0.0003" and run.data.params["rewards"].startswith("[{")
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    assert len(images) == 2 and all("+step+" in p for p in images)
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "rollouts")]
    assert tables == ["rollouts/step_000001.md", "rollouts/step_000002.md"]
    table = client.download_artifacts(run.info.run_id, tables[0], str(tmp_path))
    assert "| what colour? | green | blue | 0.00 |" in Path(table).read_text()
    # W&B (offline): the same tags against `step`, the histogram, the picture and a table with the images
    rows = history(out)
    logged = {key for row in rows for key in row}
    assert {
        tags.REWARD_MEAN,
        tags.LOSS_POLICY,
        tags.REWARD_HIST,
        tags.SAMPLES_IMAGE,
        tags.SAMPLES_TABLE,
    } <= logged
    assert tags.LOSS_KL not in logged
    assert [r[tags.REWARD_MEAN] for r in rows if tags.REWARD_MEAN in r] == [0.1, 0.2]
    assert [r["step"] for r in rows if tags.SAMPLES_TABLE in r] == [1, 2]
    table_row = next(r for r in rows if tags.SAMPLES_TABLE in r)[tags.SAMPLES_TABLE]
    assert table_row["_type"] == "table-file" and table_row["nrows"] == 2
    assert run_ids(out) == {ids["wandb"]["id"]}


def test_a_resumed_run_continues_the_same_tracked_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = _cfg(out, ["mlflow", "wandb"])
    with open_trackers(cfg, RunDir.of(out), resumed=False) as trackers:
        assert trackers.tb is None  # tensorboard not listed: no event files
        _write_steps(trackers, range(1, 3))
    first = json.loads((out / "trackers.json").read_text())
    with open_trackers(cfg, RunDir.of(out), resumed=True) as trackers:
        _write_steps(trackers, range(2, 4))  # the resumed run re-runs step 2
    assert json.loads((out / "trackers.json").read_text()) == first
    assert not (out / "tensorboard").exists()
    client = _mlflow_client(out)
    steps = [m.step for m in client.get_metric_history(first["mlflow"]["run_id"], tags.REWARD_MEAN)]
    assert sorted(steps) == [1, 2, 2, 3]  # MLflow keeps both values of the re-run step
    assert len(client.search_runs([client.get_experiment_by_name("visionrl").experiment_id])) == 1
    assert run_ids(out) == {first["wandb"]["id"]}
    assert [r["step"] for r in history(out) if tags.REWARD_MEAN in r] == [1, 2, 2, 3]
    # a fresh start (not a resume) begins new tracked runs
    with open_trackers(cfg, RunDir.of(out), resumed=False):
        pass
    again = json.loads((out / "trackers.json").read_text())
    assert (
        again["mlflow"]["run_id"] != first["mlflow"]["run_id"]
        and again["wandb"]["id"] != first["wandb"]["id"]
    )


def test_the_tracker_list_is_checked_at_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="names a tracker twice"):
        _cfg(tmp_path, ["mlflow", "mlflow"])
    with pytest.raises(ConfigError, match="logging.trackers"):
        _cfg(tmp_path, ["comet"])
    with pytest.raises(ConfigError, match="at least 1"):
        _cfg(tmp_path, [])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"names wandb, which is not installed here: pip install 'visionrl\[trackers\]'"
    ):
        _cfg(tmp_path, ["tensorboard", "wandb"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_mlflow_server_that_does_not_answer_is_named_before_the_run(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{_free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(
        InputError, match=f"MLflow at {uri} refused or did not answer.*logging.mlflow.tracking_uri"
    ):
        open_trackers(
            _cfg(tmp_path / "run", ["tensorboard", "mlflow"], tracking_uri=uri),
            RunDir.of(tmp_path / "run"),
            False,
        )
    assert time.perf_counter() - t0 < 60  # bounded retries, not MLflow's 7 with backoff (minutes)
    assert not (tmp_path / "run" / "trackers.json").exists()


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Any:
    """A real `mlflow server` on 127.0.0.1 (its own database and artifact folder), stopped after the test."""
    port = _free_port()
    store = tmp_path / "server"
    store.mkdir()
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{store / 'db.sqlite'}", "--artifacts-destination", str(store / "artifacts"),
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        yield proc, uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_a_real_mlflow_server_receives_the_run_and_its_loss_mid_run_is_survived(
    tmp_path: Path, mlflow_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow import MlflowClient

    proc, uri = mlflow_server
    out = tmp_path / "run"
    cfg = _cfg(out, ["tensorboard", "mlflow"], tracking_uri=uri, experiment="grpo")
    with open_trackers(cfg, RunDir.of(out), resumed=False) as trackers:
        _write_steps(trackers, range(1, 3))
        client = MlflowClient(tracking_uri=uri)
        run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
        steps = [m.step for m in client.get_metric_history(run_id, tags.REWARD_MEAN)]
        assert steps == [1, 2]
        assert any(
            a.path.endswith(".png") for a in client.list_artifacts(run_id, "images")
        )  # through the server
        os.killpg(proc.pid, 15)  # the tracking server goes away mid-run
        proc.wait(timeout=30)
        with caplog.at_level(logging.WARNING, logger="visionrl"):
            _write_steps(trackers, range(3, 5))  # no exception: the run goes on
        assert list(trackers.dropped) == ["mlflow"] and trackers.dropped["mlflow"].startswith("step 3")
    assert "mlflow stopped receiving this run's metrics at step 3" in caplog.text
    assert [s for s, _ in read_scalars(out / "tensorboard")[tags.REWARD_MEAN]] == [1, 2, 3, 4]
