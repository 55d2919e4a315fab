"""Deployment recipes: the Slurm (HyperPod) launcher against a fake one-node Slurm, the KubeRay job, the image.

The launcher test is real apart from Slurm itself: `srun`/`scontrol` are small stand-ins that run commands on
this machine (each srun step in its own process group, ended like Slurm ends a step), the Ray cluster is real,
and the command it runs is a real `visionrl train` that attaches through RAY_ADDRESS.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_SRUN = """#!/usr/bin/env bash
# Stand-in for srun: drop srun's options, run the command here in its own process group; on TERM/INT end the
# whole group, as Slurm ends the processes of a job step.
while [[ $# -gt 0 && $1 == -* ]]; do case $1 in -w|-N|-n) shift 2;; *) shift;; esac; done
setsid "$@" & child=$!
echo "$child" >> "$FAKE_SLURM_PGIDS"
trap 'kill -TERM -$child 2>/dev/null; sleep 2; kill -KILL -$child 2>/dev/null; exit 0' TERM INT
wait $child
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] && tr ',' '\\n' <<< "$3"
"""


def _free_port_pair() -> int:
    """A port p with p and p+1 free, above Ray's worker port range (10002-19999)."""
    for _ in range(200):
        port = random.randint(20000, 29000)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair found")


def _kill_groups(pgid_file: Path) -> None:
    if not pgid_file.exists():
        return
    for line in pgid_file.read_text().split():
        try:
            os.killpg(int(line), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fake_slurm(tmp_path: Path, ray_tmp: str) -> dict[str, str]:
    """The environment of a one-node fake Slurm allocation (srun/scontrol stand-ins on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    pgids = tmp_path / "pgids"
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}",
        "FAKE_SLURM_PGIDS": str(pgids),
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": "4242",
        "VISIONRL_RAY_HEAD_IP": "127.0.0.1",
        "VISIONRL_RAY_PORT": str(_free_port_pair()),
        "VISIONRL_RAY_TMP": ray_tmp,
        "VISIONRL_RAY_WAIT_S": "90",
    }
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.slow
def test_slurm_launcher_runs_visionrl_train_on_its_ray_cluster(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    ray_tmp = tempfile.mkdtemp(prefix="vrl-slurm-", dir="/tmp")  # Ray's socket paths must stay short
    env, pgids = _fake_slurm(tmp_path, ray_tmp), tmp_path / "pgids"
    run = tmp_path / "run"
    cmd = [
        str(REPO / "deploy" / "slurm" / "ray_cluster.sh"), "--",
        "visionrl", "train", str(REPO / "configs" / "demo.yaml"),
        f"output_dir={run}", f"model.path={tiny_model}", f"data.train={color_data / 'train.jsonl'}",
        "data.eval=null", "train.target_accuracy=null", "train.steps=1", "rollout.engine=hf",
        "rollout.prompts_per_step=2", "ray.num_cpus=null",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "1/1 node(s) joined" in out
        assert "Connecting to existing Ray cluster" in out  # visionrl attached through RAY_ADDRESS
        assert (run / "adapter" / "visionrl_manifest.json").is_file()
        assert len((run / "history.jsonl").read_text().splitlines()) == 1
        # Every process of the cluster ended with the launcher.
        alive = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.split()
        assert not alive, f"Ray processes left running: {alive}"
    finally:
        _kill_groups(pgids)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.slow
def test_slurm_launcher_passes_sigterm_on_and_keeps_ray_until_visionrl_has_checkpointed(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    """SIGTERM to the launcher (Slurm's `--signal=B:TERM@...` before the time limit): visionrl gets it, checkpoints
    its last completed step on the still running cluster and exits 143; the launcher exits 143 after it and
    ends every Ray process."""
    import time

    ray_tmp = tempfile.mkdtemp(prefix="vrl-slurm-", dir="/tmp")
    env, pgids = _fake_slurm(tmp_path, ray_tmp), tmp_path / "pgids"
    run, history = tmp_path / "run", tmp_path / "run" / "history.jsonl"
    cmd = [
        str(REPO / "deploy" / "slurm" / "ray_cluster.sh"), "--",
        "visionrl", "train", str(REPO / "configs" / "demo.yaml"),
        f"output_dir={run}", f"model.path={tiny_model}", f"data.train={color_data / 'train.jsonl'}",
        "data.eval=null", "train.target_accuracy=null", "train.steps=500", "rollout.engine=hf",
        "rollout.prompts_per_step=2", "ray.num_cpus=null", "logging.save_every=1000", "--resume", "auto",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if history.exists() and len(history.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 143, out[-3000:]
        from visionrl.checkpoint import latest_checkpoint, load_checkpoint

        steps = len(history.read_text().splitlines())
        assert load_checkpoint(latest_checkpoint(run)).step == steps
        assert f"interrupted by SIGTERM: checkpointed step {steps}" in out
        alive = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.split()
        assert not alive, f"Ray processes left running: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_groups(pgids)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_slurm_launcher_refuses_to_run_outside_an_allocation(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        [str(REPO / "deploy" / "slurm" / "ray_cluster.sh"), "--", "true"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "inside a Slurm allocation" in proc.stderr
