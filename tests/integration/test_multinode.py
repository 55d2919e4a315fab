"""A Ray cluster of three nodes on this host (a head and two workers, each started with `ray start`, each its own
raylet): a job attached by `ray.address` runs its 2 learner ranks on two different nodes and its 2 engines on two
different nodes, and the cluster is gone afterwards."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from local_cluster import LocalCluster
from visionrl.config import config_from_dict

pytestmark = pytest.mark.slow


def _nodes(line: str, role: str) -> list[str]:
    """The node ids of `role` (learner or engine) actors in the start-up placement line, by index."""
    return [node for _, node in sorted(re.findall(rf"{role} (\d+) \{{'node': '(\w+)'", line))]


def test_a_job_spreads_learner_ranks_and_engines_over_the_nodes(
    tiny_model: Path, color_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch
) -> None:
    from visionrl.orchestrate.loop import train

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as the cluster was started
    nodes = [{"num_cpus": 1}, {"num_cpus": 1}, {"num_cpus": 1}]
    with LocalCluster(nodes, keep_logs=tmp_path / "cluster-logs") as cluster:
        assert cluster.alive_nodes() == 3
        cfg = config_from_dict(
            {
                "output_dir": str(tmp_path / "run"),
                "model": {"path": str(tiny_model), "dtype": "float32"},
                "data": {"train": str(color_data / "train.jsonl")},
                "rewards": [{"name": "exact_match"}],
                "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
                "algorithm": {"group_size": 2},
                "rollout": {"engine": "hf", "prompts_per_step": 4, "max_new_tokens": 2, "num_engines": 2},
                "train": {"steps": 2, "torch_threads": 1},
                "logging": {"eval_every": 100, "save_every": 2},
                "ray": {"address": cluster.address, "num_learners": 2},
            }
        )
        with caplog.at_level(logging.INFO, logger="visionrl.orchestrate.actors"):
            result = train(cfg)
        assert [h["learner/ranks"] for h in result.history] == [2.0, 2.0]
        assert (result.adapter_dir / "visionrl_manifest.json").is_file()
        assert cluster.alive_nodes() == 3  # the job disconnected; the cluster is the operator's
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("placement "))
    learners, engines = _nodes(line, "learner"), _nodes(line, "engine")
    assert len(learners) == 2 and len(set(learners)) == 2, line
    assert len(engines) == 2 and len(set(engines)) == 2, line
    assert cluster.stray == [] and cluster.leftovers() == []  # stopped cleanly: nothing left running
