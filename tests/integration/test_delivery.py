"""The policy the engine samples is the policy being trained: a start-up probe and a per-step check, tested with
engines that ignore adapters or silently drop syncs (fault injection inside the real Ray actors)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from visionrl.config import JobConfig, config_from_dict
from visionrl.errors import RunError

pytestmark = pytest.mark.slow


def _cfg(model: Path, data: Path, out: Path, engine: str, **over: dict) -> JobConfig:
    raw = {
        "output_dir": str(out),
        "model": {"path": str(model), "dtype": "float32"},
        "data": {"train": str(data / "train.jsonl")},
        "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
        "lora": {"rank": 8, "alpha": 16, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 4},
        "rollout": {"engine": engine, "prompts_per_step": 8, "max_new_tokens": 4, "max_model_len": 256},
        "train": {"lr": 2e-2, "lr_schedule": "constant", "torch_threads": 1, "steps": 8},
        "logging": {"eval_every": 100, "save_every": 100, "images_every": 100},
        "ray": {"num_cpus": 2},
    }
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return config_from_dict(raw)


@pytest.fixture
def fault(request: pytest.FixtureRequest) -> Iterator[str]:
    """Set VISIONRL_FAULTS for the run (its actors get it, also on a shared Ray), and restore the environment
    after."""
    old = os.environ.get("VISIONRL_FAULTS")
    os.environ["VISIONRL_FAULTS"] = request.param
    yield request.param
    if old is None:
        os.environ.pop("VISIONRL_FAULTS", None)
    else:
        os.environ["VISIONRL_FAULTS"] = old


@pytest.mark.parametrize("fault", ["ignore_adapters"], indirect=True)
@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_an_engine_that_ignores_adapters_stops_the_run_at_start(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, fault: str, engine: str
) -> None:
    from visionrl.orchestrate.loop import train

    with pytest.raises(RunError, match=r"rollout engine\(s\) \[0\] ignore the LoRA adapter") as err:
        train(_cfg(tiny_model, color_data, tmp_path / "run", engine))
    assert "tower-connector" in str(err.value) and "max_lora_rank" in str(err.value)
    assert not (tmp_path / "run" / "history.jsonl").exists()  # stopped before the first step


@pytest.mark.parametrize("fault", ["drop_adapter_syncs"], indirect=True)
def test_silently_dropped_syncs_stop_the_run_and_say_why(
    tiny_model: Path, color_data: Path, tmp_path: Path, shared_ray, fault: str
) -> None:
    """The engine loads version 1, then acknowledges versions 2, 3, ... without loading them. Steps 1-2 sample
    with the learner's version (mismatch about 1e-6 in float32); from step 3 on the engine serves version 1 while
    the learner is at 2, 3, ...: the mismatch rises over the threshold and two such steps stop the run."""
    import json

    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        "vllm",
        rollout={"max_logprob_diff": 0.01, "max_logprob_diff_steps": 2},
    )
    with pytest.raises(RunError, match="not sampling the policy being trained") as err:
        train(cfg)
    assert "rollout.max_logprob_diff=0.01" in str(err.value)
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    diffs = [h["rollout/logprob_diff"] for h in history]
    assert diffs[0] < 1e-3 and diffs[1] < 1e-3, diffs  # versions 0 and 1 really reached the engine
    assert len(history) < 8 and all(d > 0.01 for d in diffs[-1:]), diffs
