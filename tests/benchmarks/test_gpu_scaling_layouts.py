"""benchmarks/gpu_scaling.py's layouts are jobs the config accepts, placed as the scaling issue asks: the
colocated layout pairs learner rank i with engine i on GPU i (FSDP2 over 2 ranks), the split layout gives the
engine and the learner a GPU each and samples one step ahead. Checked on the CPU, before device time is spent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from visionrl.config import load_config
from visionrl.train.ranks import use_fsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_scaling

GPU = {"GPU": 1.0, "CPU": 0.001}


def _job(layout: str, tmp_path: Path, smoke: bool = False):  # type: ignore[no-untyped-def]
    over = gpu_scaling.layout_overrides(layout, smoke)
    base = gpu_scaling.overrides_for("64x8x512", tmp_path / "m", tmp_path / "d", tmp_path / "r", 2, smoke)
    return load_config(gpu_scaling.JOB, base + over)


def test_one_gpu_layout_is_the_shipped_job_with_the_engine_asleep_during_the_update(tmp_path: Path) -> None:
    cfg = _job("1gpu", tmp_path)
    plan = cfg.placement_plan()
    assert (plan.bundles, plan.learners, plan.engines) == ([GPU], [0], [0])
    assert cfg.rollout.sleep_during_update and cfg.train.micro_batch_tokens == 8192
    assert (cfg.rollout.prompts_per_step, cfg.algorithm.group_size, cfg.rollout.max_new_tokens) == (
        64,
        8,
        512,
    )


def test_colocated_layout_shards_two_ranks_and_pairs_each_with_an_engine_on_its_gpu(tmp_path: Path) -> None:
    cfg = _job("colocated", tmp_path)
    plan = cfg.placement_plan()
    assert (plan.bundles, plan.learners, plan.engines) == ([GPU, GPU], [0, 1], [0, 1])
    assert use_fsdp(cfg.train.fsdp, cfg.ray.num_learners, "cuda")


def test_split_layout_gives_engine_and_learner_a_gpu_each_and_samples_one_step_ahead(tmp_path: Path) -> None:
    cfg = _job("split-async", tmp_path)
    plan = cfg.placement_plan()
    assert plan.bundles == [] and (cfg.ray.learner_gpus, cfg.rollout.gpus_per_engine) == (1.0, 1.0)
    assert cfg.rollout.async_steps == 1 and not cfg.rollout.sleep_during_update
    assert cfg.algorithm.old_logprobs == "engine" and cfg.algorithm.rollout_correction == "off"


def test_speed_up_and_efficiency_are_against_the_one_gpu_row() -> None:
    rows = [{"layout": "1gpu", "gpus": 1, "step_s": 90.0}, {"layout": "colocated", "gpus": 2, "step_s": 60.0}]
    gpu_scaling.compare(rows)
    assert rows[1]["step_speedup_vs_1gpu"] == pytest.approx(1.5)
    assert rows[1]["scaling_efficiency"] == pytest.approx(0.75)
    assert rows[0]["scaling_efficiency"] == pytest.approx(1.0)


@pytest.mark.parametrize("layout", list(gpu_scaling.LAYOUTS))
def test_the_cpu_smoke_run_keeps_each_layouts_ranks_engines_and_async_steps(
    layout: str, tmp_path: Path
) -> None:
    gpu, cpu = _job(layout, tmp_path), _job(layout, tmp_path, smoke=True)
    assert (cpu.ray.num_learners, cpu.rollout.num_engines, cpu.rollout.async_steps) == (
        gpu.ray.num_learners,
        gpu.rollout.num_engines,
        gpu.rollout.async_steps,
    )
    assert cpu.algorithm.old_logprobs == gpu.algorithm.old_logprobs
    assert cpu.ray.learner_gpus == 0 and cpu.rollout.gpus_per_engine == 0 and cpu.rollout.engine == "hf"
