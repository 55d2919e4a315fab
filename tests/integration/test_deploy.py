"""Deployment recipes: the Slurm (HyperPod) launcher against a fake Slurm of one and of two nodes.

The launcher tests are real apart from Slurm itself: `srun`/`scontrol` are small stand-ins that run commands on
this machine (each srun step in its own process group, ended like Slurm ends a step, every node of the fake
allocation being this machine) and the Ray cluster is real. On one node the command is a real `visionrl train`
that attaches through RAY_ADDRESS; on two nodes a stand-in `visionrl` reports its arguments and the cluster.
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
# Stand-in for srun: drop srun's options, log the node (-w, or "!NODE" for --exclude=NODE) and the command to
# $FAKE_SLURM_LOG, run the command here in its own process group; on TERM/INT end the whole group, as Slurm
# ends the processes of a job step.
node=""
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in -w) node=$2; shift 2;; --exclude=*) node="!${1#*=}"; shift;; -N|-n) shift 2;; *) shift;; esac
done
echo "$node $*" >> "$FAKE_SLURM_LOG"
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


def _fake_slurm(tmp_path: Path, ray_tmp: str, nodes: str = "localhost") -> dict[str, str]:
    """The environment of a fake Slurm allocation of `nodes` (srun/scontrol stand-ins on PATH; every node is
    this machine)."""
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
        "FAKE_SLURM_LOG": str(tmp_path / "srun.log"),
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_JOB_NUM_NODES": str(len(nodes.split(","))),
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
        assert "[visionrl] attaching to Ray at " in out  # visionrl attached through RAY_ADDRESS
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


FAKE_VISIONRL = """#!{python}
# Stand-in for `visionrl`: what the head node would run, and the Ray cluster it finds through RAY_ADDRESS.
import json, os, sys

import ray

ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
nodes = [node for node in ray.nodes() if node["Alive"]]
seen = {{"argv": sys.argv[1:], "gpus": sorted(node["Resources"].get("GPU", 0) for node in nodes)}}
ray.shutdown()
with open(os.environ["FAKE_VISIONRL_OUT"], "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.slow
def test_sbatch_on_two_nodes_starts_a_ray_node_on_each_and_one_learner_rank_per_gpu(tmp_path: Path) -> None:
    """`visionrl.sbatch` in a fake allocation of 2 nodes x 2 GPUs: srun starts the Ray head on the first node
    and the workers (one step) on every other node, each offering its 2 GPUs; the head runs `visionrl train`
    with ray.num_learners=4 (2 x 2) on the cluster of both nodes; nothing of Ray is left running."""
    import json

    ray_tmp = tempfile.mkdtemp(prefix="vrl-slurm-", dir="/tmp")
    env, pgids = _fake_slurm(tmp_path, ray_tmp, nodes="vrl-a,vrl-b"), tmp_path / "pgids"
    (tmp_path / "bin" / "visionrl").write_text(FAKE_VISIONRL.format(python=sys.executable))
    (tmp_path / "bin" / "visionrl").chmod(0o755)
    seen_file = tmp_path / "visionrl.json"
    env |= {
        "FAKE_VISIONRL_OUT": str(seen_file),
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_CPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(REPO),
        "VISIONRL_VENV": str(tmp_path / "no-venv"),  # the stand-in visionrl on PATH, not the venv's
    }
    job = str(REPO / "configs" / "demo.yaml")
    cmd = ["bash", str(REPO / "deploy" / "slurm" / "visionrl.sbatch"), job, "train.steps=3"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "2/2 node(s) joined" in out
        port = env["VISIONRL_RAY_PORT"]
        # Both srun steps start in the background: their lines come in either order.
        worker, head = sorted((tmp_path / "srun.log").read_text().splitlines())  # "!" sorts before letters
        assert head.startswith(f"vrl-a ray start --head --block --node-ip-address=127.0.0.1 --port={port} ")
        assert worker.startswith(f"!vrl-a ray start --block --address=127.0.0.1:{port} ")  # all but the head
        assert head.endswith(" --num-cpus=1 --num-gpus=2") and worker.endswith(" --num-cpus=1 --num-gpus=2")
        seen = json.loads(seen_file.read_text())
        assert seen["argv"] == ["train", job, "train.steps=3", "ray.num_learners=4", "--resume", "auto"]
        assert seen["gpus"] == [2.0, 2.0]  # the cluster spans both nodes, with their GPUs
        alive = subprocess.run(["pgrep", "-f", ray_tmp], capture_output=True, text=True).stdout.split()
        assert not alive, f"Ray processes left running: {alive}"
    finally:
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
