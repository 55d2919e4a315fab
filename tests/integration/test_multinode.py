"""A Ray cluster of two nodes on this host (a head and a worker, each started with `ray start`, each its own
raylet): `visionrl train`, attached by `ray.address`, runs its 2 learner ranks on the two different nodes and its
2 engines on the two different nodes, and the cluster is gone afterwards. The job is one small step: this proves
placement over nodes and the ranks' step across them, not learning."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from local_cluster import LocalCluster

pytestmark = pytest.mark.slow

VISIONRL = str(Path(sys.executable).parent / "visionrl")


def _nodes(line: str, role: str) -> list[str]:
    """The node ids of `role` (learner or engine) actors in the start-up placement line, by index."""
    return [node for _, node in sorted(re.findall(rf"{role} (\d+) \{{'node': '(\w+)'", line))]


def test_a_job_spreads_learner_ranks_and_engines_over_the_nodes(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    nodes = [{"num_cpus": 1}, {"num_cpus": 1}]
    with LocalCluster(nodes, keep_logs=tmp_path / "cluster-logs") as cluster:
        assert cluster.alive_nodes() == 2
        job = {
            "output_dir": str(run),
            "model": {"path": str(tiny_model), "dtype": "float32"},
            "data": {"train": str(color_data / "train.jsonl")},
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
            "algorithm": {"group_size": 2},
            # 2 prompts: one for each engine; their 4 completions split over the 2 learner ranks
            "rollout": {"engine": "hf", "prompts_per_step": 2, "max_new_tokens": 2, "num_engines": 2},
            "train": {"steps": 1, "torch_threads": 1},
            "logging": {"eval_every": 100, "save_every": 1},
            "ray": {"address": cluster.address, "num_learners": 2},
        }
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # as the cluster was started
        cmd = [VISIONRL, "train", str(tmp_path / "job.yaml")]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0 and "died during start-up" in proc.stdout + proc.stderr:
            # Seen about once in four runs after other Ray tests on the loaded 2-core machine: a learner actor
            # "cancelled before it started running" on the freshly started cluster (docs/ENGINE_NOTES.md,
            # "Ray 2.60"); not understood yet. The job runs once more then; any other failure fails at once.
            shutil.rmtree(run, ignore_errors=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert cluster.alive_nodes() == 2  # the job disconnected; the cluster is the operator's
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [h["learner/ranks"] for h in history] == [2.0]
    assert history[0]["learner/tokens"] > 0  # the ranks trained on the step's completions
    assert (run / "adapter" / "visionrl_manifest.json").is_file()
    log = (run / "visionrl.log").read_text()
    line = next(ln for ln in log.splitlines() if "placement " in ln and "running:" in ln)
    learners, engines = _nodes(line, "learner"), _nodes(line, "engine")
    assert len(learners) == 2 and len(set(learners)) == 2, line
    assert len(engines) == 2 and len(set(engines)) == 2, line
    assert cluster.stray == [] and cluster.leftovers() == []  # stopped cleanly: nothing left running
