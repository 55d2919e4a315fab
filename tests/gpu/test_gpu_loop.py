"""The loop's GPU code path: learner and HF engine as Ray actors sharing one GPU (colocated placement)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from visionrl.config import config_from_dict

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("fsdp", ["auto", "on"])  # on: the learner rank's actor shards with FSDP2 over nccl
def test_colocated_loop_on_one_gpu(tiny_model: Path, color_data: Path, tmp_path: Path, fsdp: str) -> None:
    from visionrl.metrics import read_scalars
    from visionrl.orchestrate.loop import train

    cfg = config_from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model), "dtype": "bfloat16"},
            "data": {
                "train": str(color_data / "train.jsonl"),
                "eval": str(color_data / "eval.jsonl"),
                "max_eval_samples": 16,
            },
            "rewards": [{"name": "exact_match"}],
            "lora": {"rank": 16, "train_merger": True, "train_lm_head": True},
            "algorithm": {"group_size": 4},
            "rollout": {"engine": "hf", "prompts_per_step": 8, "max_new_tokens": 4, "gpus_per_engine": 0.5},
            "train": {"steps": 3, "lr": 1e-3, "fsdp": fsdp},
            "logging": {"eval_every": 3},
            "ray": {"placement": "colocated", "learner_gpus": 0.5},
        }
    )
    result = train(cfg)
    assert [h["rollout/adapter_version"] for h in result.history] == [0.0, 1.0, 2.0]
    assert [h["learner/ranks"] for h in result.history] == [1.0, 1.0, 1.0]
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert len(scalars["policy/grad_norm"]) == 3
    assert (result.adapter_dir / "visionrl_manifest.json").is_file()


@pytest.mark.parametrize(
    ("placement", "learner_gpus", "engine_gpus", "same_gpu"),
    [
        ("colocated", 0.5, 0.5, True),
        pytest.param(
            "split",
            1,
            1,
            False,
            marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
        ),
    ],
)
def test_placement_of_learner_and_engine(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    placement: str,
    learner_gpus: float,
    engine_gpus: float,
    same_gpu: bool,
) -> None:
    import ray

    from visionrl.orchestrate.actors import start_actors
    from visionrl.orchestrate.ray_session import ray_session

    cfg = config_from_dict(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"path": str(tiny_model), "dtype": "bfloat16"},
            "data": {"train": str(color_data / "train.jsonl")},
            "rewards": [{"name": "exact_match"}],
            "algorithm": {"group_size": 2},
            "rollout": {"engine": "hf", "prompts_per_step": 2, "gpus_per_engine": engine_gpus},
            "ray": {"placement": placement, "learner_gpus": learner_gpus},
        }
    )
    with ray_session(cfg.ray):
        learners, engines, _ = start_actors(cfg)
        places = ray.get([learners[0].placement.remote(), engines[0].placement.remote()])
    assert len(places[0]["gpus"]) == 1 and len(places[1]["gpus"]) == 1
    assert (places[0]["gpus"] == places[1]["gpus"]) is same_gpu, places
