"""The deployment files say what they run: the sbatch script, the KubeRay job and the Dockerfile."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def test_sbatch_script_runs_the_launcher_with_visionrl_train() -> None:
    text = (REPO / "deploy" / "slurm" / "visionrl.sbatch").read_text()
    assert "#SBATCH --nodes=" in text and "#SBATCH --gpus-per-node=" in text
    assert (
        'deploy/slurm/ray_cluster.sh -- visionrl train "$@" --resume auto' in text
    )  # a requeued job continues
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:TERM@" in text
    proc = subprocess.run(
        ["bash", "-n", str(REPO / "deploy" / "slurm" / "visionrl.sbatch")], capture_output=True
    )
    assert proc.returncode == 0, proc.stderr


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
