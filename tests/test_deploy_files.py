"""The deployment files say what they run: the sbatch script, the KubeRay job and the Dockerfile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def test_sbatch_script_runs_the_launcher_with_visionrl_train() -> None:
    text = (REPO / "deploy" / "slurm" / "visionrl.sbatch").read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --gpus-per-node=" in text
    # a requeued job continues; the learner ranks (one per GPU) come after the user's overrides
    assert 'deploy/slurm/ray_cluster.sh -- visionrl train "$@" "${learners[@]}" --resume auto' in text
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:TERM@" in text
    proc = subprocess.run(
        ["bash", "-n", str(REPO / "deploy" / "slurm" / "visionrl.sbatch")], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr


def _sbatch_command(tmp_path: Path, args: list[str], **slurm: str) -> list[str]:
    """The command `visionrl.sbatch ARGS` hands to the launcher in an allocation with these SLURM_* variables (a
    stand-in launcher in the submit directory prints it, one argument a line)."""
    launcher = tmp_path / "submit" / "deploy" / "slurm" / "ray_cluster.sh"
    launcher.parent.mkdir(parents=True)
    launcher.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env |= {f"SLURM_{k}": v for k, v in slurm.items()}
    env |= {
        "SLURM_SUBMIT_DIR": str(launcher.parents[2]),
        "VISIONRL_VENV": str(tmp_path / "no-venv"),
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",  # python3 with PyYAML reads the job file
    }
    script = REPO / "deploy" / "slurm" / "visionrl.sbatch"
    proc = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if not line.startswith("[visionrl.sbatch]")]


@pytest.mark.parametrize(
    ("slurm", "learners"),
    [
        ({"JOB_NUM_NODES": "2", "GPUS_ON_NODE": "8"}, ["ray.num_learners=16"]),  # 2 nodes x 8 GPUs
        ({"JOB_NUM_NODES": "3", "GPUS_PER_NODE": "h100:4"}, ["ray.num_learners=12"]),  # 3 x 4, typed GPUs
        ({"JOB_NUM_NODES": "1", "GPUS_ON_NODE": "1"}, ["ray.num_learners=1"]),
        ({"JOB_NUM_NODES": "2"}, []),  # no GPUs allocated: the job file decides
    ],
)
def test_sbatch_asks_for_one_learner_rank_per_gpu_of_the_allocation(
    tmp_path: Path, slurm: dict[str, str], learners: list[str]
) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("ray:\n  num_cpus: 4\n")
    command = _sbatch_command(tmp_path, [str(job), "train.steps=3"], **slurm)
    assert command == ["--", "visionrl", "train", str(job), "train.steps=3", *learners, "--resume", "auto"]


def test_sbatch_keeps_ray_num_learners_the_user_set(tmp_path: Path) -> None:
    """Set in the job file or as an override: the sbatch script adds none of its own."""
    gpus = {"JOB_NUM_NODES": "2", "GPUS_ON_NODE": "8"}
    job = tmp_path / "job.yaml"
    job.write_text("ray:\n  num_learners: 4\n")
    assert _sbatch_command(tmp_path / "a", [str(job)], **gpus) == [
        "--", "visionrl", "train", str(job), "--resume", "auto"
    ]  # fmt: skip
    job.write_text("train:\n  steps: 3\n")
    assert _sbatch_command(tmp_path / "b", [str(job), "ray.num_learners=2"], **gpus) == [
        "--", "visionrl", "train", str(job), "ray.num_learners=2", "--resume", "auto"
    ]  # fmt: skip


def test_kuberay_job_runs_the_production_config_from_the_image() -> None:
    job = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    entry = spec["entrypoint"].split()
    assert entry[:2] == ["visionrl", "train"] and entry[-2:] == ["--resume", "auto"]  # retries continue
    assert spec["backoffLimit"] >= 1
    config = entry[2].removeprefix("/workspace/")
    assert (REPO / config).is_file(), f"the entrypoint's job file {config} is not in the repository"
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert head["image"] == workers["image"]
    assert int(workers["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert spec.get("shutdownAfterJobFinishes") is True


def test_dockerfile_installs_the_package_with_vllm() -> None:
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert "COPY pyproject.toml" in text and "COPY src" in text and "COPY configs" in text
    assert ".[gpu]" in text  # vLLM (CUDA build) comes with the gpu extra
    assert 'ENTRYPOINT ["visionrl"]' in text
