"""Preemption as clusters do it: SIGTERM to `visionrl train` mid-run checkpoints the last completed step, exits
143 and leaves no process or Ray temp dir behind; the same command re-run (`--resume auto`, what HyperPod
auto-resume and a requeued Slurm job do) continues after that step, exactly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

VISIONRL = str(Path(sys.executable).parent / "visionrl")
DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")


def _args(run: Path, model: Path, data: Path) -> list[str]:
    return [
        DEMO, f"output_dir={run}", f"model.path={model}", f"data.train={data / 'train.jsonl'}", "data.eval=null",
        "train.target_accuracy=null", "rollout.engine=hf", "rollout.prompts_per_step=2", "algorithm.group_size=4",
        # no periodic checkpoint: the one the run has at the end is the one SIGTERM made it write
        "logging.save_every=1000",
    ]  # fmt: skip


def _steps(history: Path) -> list[int]:
    return [json.loads(line)["step"] for line in history.read_text().splitlines()]


def test_sigterm_checkpoints_the_last_step_and_auto_resume_continues(
    tiny_model: Path, color_data: Path, tmp_path: Path
) -> None:
    run, history = tmp_path / "run", tmp_path / "run" / "history.jsonl"
    args = _args(run, tiny_model, color_data)
    # `--resume auto` on an empty output_dir starts fresh
    proc = subprocess.Popen(
        [VISIONRL, "train", *args, "train.steps=500", "--resume", "auto"],
        start_new_session=True,  # its own process group, to find every process it leaves
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if history.exists() and len(history.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)  # to the main process only, as Kubernetes and `scancel -b` do
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            subprocess.run(["kill", "-KILL", f"-{proc.pid}"], check=False)
    assert proc.returncode == 143, out[-3000:]
    done = _steps(history)
    assert done == list(range(1, len(done) + 1)) and len(done) >= 3
    # the last completed step is checkpointed, whether the signal came during its rollout or its update
    assert f"interrupted by SIGTERM: checkpointed step {done[-1]}" in out, out[-3000:]
    from visionrl.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = load_checkpoint(latest_checkpoint(run))
    assert ckpt.step == done[-1]
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the run still alive: {left}"
    temp = re.search(r"starting a local Ray \(\d+ CPUs, in ([^)]+)\)", (run / "visionrl.log").read_text())
    assert temp and not Path(temp.group(1)).exists(), "the run's Ray temp dir was left behind"
    assert yaml.safe_load((run / "config.yaml").read_text())["resume"] == "auto"

    # The same job re-run, now with `resume: auto` from the job's keys: it continues after the checkpoint.
    resumed = subprocess.run(
        [VISIONRL, "train", *args, f"train.steps={ckpt.step + 2}", "resume=auto"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(history) == list(range(1, ckpt.step + 3))  # no step twice, none missing
    assert f"resumed from {ckpt.path}" in (run / "visionrl.log").read_text()
