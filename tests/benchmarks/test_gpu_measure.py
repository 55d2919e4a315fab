"""benchmarks/gpu_measure.sh runs each part's command with the folders and settings it says, on a stand-in GPU
(a fake nvidia-smi and python on PATH that record what they were asked)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, gpu: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho '{gpu}'\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "WORK": str(tmp_path / "work")}  # fmt: skip
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_measure.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_a_step_part_on_an_h200_merges_into_the_committed_results(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "NVIDIA H200, 143771 MiB", "spread", "rollout.gpu_memory_utilization=0.5")
    assert proc.returncode == 0, proc.stderr
    work = tmp_path / "work"
    assert calls == [
        f"benchmarks/gpu_grpo_step.py --sizes 64x8x512 --lengths spread --steps 3 --work {work} --merge "
        f"--out {work / 'results'} rollout.gpu_memory_utilization=0.5"
    ]
    seeded = (work / "results" / "gpu_grpo_step.json").read_text()
    assert seeded == (ROOT / "benchmarks" / "results" / "gpu_grpo_step.json").read_text()
    assert (tmp_path / "out" / "gpu_grpo_step.json").exists() and "spread: exit 0" in proc.stdout


def test_another_card_starts_its_own_results_and_the_learner_runs_lean_on_80_gb(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "NVIDIA H100 80GB HBM3, 81559 MiB", "learner")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "benchmarks/gpu_learner.py --packing-levers --compile-layers --lengths both --lean "
        f"--out {tmp_path / 'work' / 'results'}"
    ]
    assert list((tmp_path / "work" / "results").iterdir()) == []


def test_an_unknown_part_is_refused_with_the_list(tmp_path: Path) -> None:
    proc, calls = _run(tmp_path, "NVIDIA H200, 143771 MiB", "bogus")
    assert proc.returncode == 2 and calls == []
    assert "learner, equal, spread, trl, rollout or tests" in proc.stderr


def test_trl_runs_both_of_its_settings_unless_one_is_named(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    work = tmp_path / "work"
    common = f"--work {work} --merge --out {work / 'results'}"
    proc, calls = _run(tmp_path, "NVIDIA H200, 143771 MiB", "trl")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        f"benchmarks/gpu_grpo_step.py --sizes 16x8x256 --trl 16x8x256 --lengths spread --trl-recompute on,off {common}"
    ]
    monkeypatch.setenv("TRL_RECOMPUTE", "off")
    proc, calls = _run(tmp_path, "NVIDIA H200, 143771 MiB", "trl")
    assert calls[-1].endswith(f"--trl-recompute off {common}")
