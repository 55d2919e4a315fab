"""The small job of the fault tests that run the real loop (Ray actors, the HF engine, the tiny Qwen3-VL): 2 prompts
x 4 completions of 2 tokens, checkpoints every step, as a config or as a job file for `visionrl train`."""

from __future__ import annotations

from pathlib import Path

import yaml

from visionrl.config import JobConfig, config_from_dict


def small_job(model: Path, data_dir: Path, out: Path, **over: dict | list) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data_dir / "train.jsonl")},
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        "lora": {"rank": 8, "alpha": 16},
        "algorithm": {"group_size": 4},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "max_new_tokens": 2, "max_model_len": 256},
        "train": {"lr": 3e-3, "torch_threads": 1, "steps": 2},
        "logging": {"save_every": 1, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = values if isinstance(values, list) else {**raw.get(section, {}), **values}
    return config_from_dict(raw)


def write_job(cfg: JobConfig, path: Path) -> str:
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return str(path)
