"""benchmarks/gpu_grpo_step.py's rows across calls: TRL's two settings (activation recompute on and off) are kept
apart when results files merge, visionrl's rows get the figures of TRL's fastest setting, and a smaller card's
setting run on a larger one (`--cap-gib`) has its overrides and a row of its own."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_grpo_step


def _trl(size: str, recompute: bool | None, learner: float, step: float) -> dict:  # type: ignore[type-arg]
    row = {
        "size": size,
        "trl_step_s": step,
        "trl_learner_tokens_per_s": learner,
        "trl_tokens_per_s_per_gpu": 1.0,
    }
    row["trl_peak_mem_gib"] = 70.0
    return row if recompute is None else {**row, "gradient_checkpointing": recompute}


def test_a_merge_replaces_only_the_trl_setting_that_ran_again() -> None:
    """The earlier file has recompute on (a row from before the setting was written: on) and off at 16x8x256;
    this call ran only off. On stays, off is the new one, the old off is superseded with its file's date."""
    earlier = {
        "date": "2026-12-01",
        "results": [{"size": "16x8x256", "step_s": 10.0}],
        "trl": [_trl("16x8x256", None, 3400.0, 22.0), _trl("16x8x256", False, 4100.0, 19.0)],
        "before": {"kept": True},
    }
    report = {"results": [], "trl": [_trl("16x8x256", False, 4200.0, 18.9)]}
    gpu_grpo_step.merge(report, earlier)
    learners = [(r.get("gradient_checkpointing", True), r["trl_learner_tokens_per_s"]) for r in report["trl"]]
    assert learners == [(True, 3400.0), (False, 4200.0)]
    assert report["results"] == [{"size": "16x8x256", "step_s": 10.0}] and report["before"] == {"kept": True}
    assert [(r["table"], r["trl_learner_tokens_per_s"], r["file_date"]) for r in report["superseded"]] == [
        ("trl", 4100.0, "2026-12-01")
    ]


def test_visionrls_rows_get_trls_fastest_setting() -> None:
    """Recompute on 3,400 tokens/s, off 4,200: visionrl's 8,400 is 2.0x the faster, and its step 10 s against
    the off setting's 18.9 s is 1.89x."""
    report = {
        "results": [{"size": "16x8x256", "step_s": 10.0, "learner_tokens_per_s": 8400.0}],
        "trl": [
            _trl("16x8x256", True, 3400.0, 22.0),
            _trl("16x8x256", False, 4200.0, 18.9),
            {"size": "16x8x256", "gradient_checkpointing": False, "status": "TRL run failed (exit 1)"},
        ],
    }
    gpu_grpo_step.attach_trl(report)
    row = report["results"][0]
    assert row["trl_gradient_checkpointing"] is False and row["trl_learner_tokens_per_s"] == 4200.0
    assert row["learner_tokens_per_s_vs_trl"] == 2.0 and row["step_speedup_vs_trl"] == 18.9 / 10.0


def test_a_smaller_cards_setting_on_a_larger_card() -> None:
    """An H100 80GB (79.6 GiB) setting on an H200 (140.4 GiB): the engine's 0.5 of 79.6 GiB is 39.8 GiB, which is
    0.2835 of the H200; the learner is capped at 79.6 GiB. Without an engine override the job's share is scaled."""
    over = ["model.gradient_checkpointing=true", "rollout.gpu_memory_utilization=0.5"]
    assert gpu_grpo_step.capped_overrides(over, 79.6, 140.4, 0.6) == [
        "model.gradient_checkpointing=true",
        "rollout.gpu_memory_utilization=0.2835",
        "train.gpu_memory_gib=79.6",
    ]
    assert gpu_grpo_step.capped_overrides([], 79.6, 140.4, 0.6)[0] == "rollout.gpu_memory_utilization=0.3402"


def test_a_capped_run_has_a_row_of_its_own() -> None:
    """The targets read the row named "64x8x512"; a run capped to an 80 GB card's memory is named apart."""
    capped = gpu_grpo_step.capped_overrides([], 79.6, 140.4, 0.6)
    assert gpu_grpo_step.row_label("64x8x512", "equal", []) == "64x8x512"
    assert gpu_grpo_step.row_label("64x8x512", "spread", ["train.packing=true"]) == "64x8x512 spread"
    assert gpu_grpo_step.row_label("64x8x512", "equal", capped) == "64x8x512 at 79.6 GiB"
    assert gpu_grpo_step.row_label("64x8x512", "spread", capped) == "64x8x512 spread at 79.6 GiB"


def test_a_cap_without_a_gpu_is_refused_before_anything_runs() -> None:
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("a machine without a GPU: here the run would start")
    import subprocess

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_grpo_step.py", "--smoke", "--cap-gib", "79.6"],
        cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")},
    )  # fmt: skip
    assert proc.returncode == 2 and "--cap-gib needs a GPU" in proc.stderr
