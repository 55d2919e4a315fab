"""The policy the engine samples is the policy being trained: a start-up probe and a per-step check, tested with
engines that ignore adapters or silently drop syncs (fault injection inside the real Ray actors)."""

from __future__ import annotations

import logging
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


@pytest.mark.parametrize(
    ("fault", "engine", "ignored", "apart"),
    [
        # no part reaches the engine
        ("ignore_adapters", "vllm", ["language model", "merger"], []),
        # the language model's LoRA reaches it, the merger's does not: a whole-adapter probe passed this
        ("skip_merger_lora", "vllm", ["merger"], []),
        # both parts change the output, by twice as much as the learner's
        ("misscale_adapters", "hf", [], ["language model", "merger"]),
    ],
    indirect=["fault"],
)
def test_an_engine_that_misapplies_a_part_stops_the_run_at_start(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    fault: str,
    engine: str,
    ignored: list[str],
    apart: list[str],
) -> None:
    from visionrl.orchestrate.loop import train

    with pytest.raises(RunError, match=r"rollout engine\(s\) \[0\] do not apply the LoRA adapter") as err:
        train(_cfg(tiny_model, color_data, tmp_path / "run", engine))
    text = str(err.value)
    named = [line for line in text.splitlines() if line.startswith("- engine 0")]
    assert len(named) == len(ignored) + len(apart), text  # the parts applied right are not named
    for part in ignored:
        assert f"the engine ignores the {part} LoRA" in text
    if "merger" in ignored:
        assert "tower-connector LoRA" in text
    for part in apart:
        assert any(
            line.startswith(f"- engine 0, {part}:") and "over rollout.max_logprob_diff" in line
            for line in named
        )
        assert "lora.alpha / lora.rank" in text
    assert not (tmp_path / "run" / "history.jsonl").exists()  # stopped before the first step


@pytest.mark.parametrize("fault", ["drop_adapter_syncs,fail_engine_batch"], indirect=True)
@pytest.mark.parametrize("serving", ["adapter", "merged"])
def test_silently_dropped_syncs_stop_the_run_and_name_the_engine(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    fault: str,
    serving: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine loads version 1, then acknowledges versions 2, 3, ... without loading them. The fingerprint
    after the first sync agrees (about 1e-6 in float32); from the sync of version 2 on the engine serves
    version 1 while the learner scores with 2, 3, ...: the gap grows with every update, and two syncs in a row
    over the bound stop the run, naming the engine. On the way, the engine fails internally in step 2's
    rollout and rebuilds itself: it is probed again before its next rollout, and passes. The same with the adapter
    merged into the engine's weights (rollout.lora_serving: merged): the check does not depend on how the engine
    serves the adapter."""
    import json

    from visionrl.orchestrate.loop import train

    cfg = _cfg(
        tiny_model,
        color_data,
        tmp_path / "run",
        "vllm",
        rollout={"max_logprob_diff": 0.01, "max_logprob_diff_steps": 2, "lora_serving": serving},
    )
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(
            RunError, match="rollout engine 0 does not serve the adapter the learner sent it"
        ) as err,
    ):
        train(cfg)
    assert "rollout engine(s) [0] rebuilt after an internal error: adapter delivery verified" in caplog.text
    assert "over rollout.max_logprob_diff=0.01, 2 syncs in a row" in str(err.value)
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    prints = [h["rollout/fingerprint_diff"] for h in history]
    assert prints[0] < 1e-3, prints  # version 1 really reached the engine
    assert len(history) < 8 and prints[-1] > 0.01, prints
    assert prints == sorted(prints), prints  # the served version stays behind by one more update each step


def test_the_engines_adapter_crosses_the_object_store_as_a_buffer_not_as_pickled_bytes(
    shared_ray: object,
) -> None:
    """The per-step payload's weights are a numpy buffer: Ray stores it out of band and a reader on the same node
    gets a read-only view of the store (no copy), with the same bytes."""
    import numpy as np
    import ray
    import torch

    from visionrl.adapter.packed import pack_safetensors
    from visionrl.types import ADAPTER_WEIGHTS, AdapterPayload

    weights = pack_safetensors({"a": torch.arange(1 << 18, dtype=torch.float32)})
    payload = AdapterPayload(version=3, files={ADAPTER_WEIGHTS: weights})
    got = ray.get(ray.put(payload))
    arrived = got.files[ADAPTER_WEIGHTS]
    assert isinstance(arrived, np.ndarray) and not arrived.flags.writeable and not arrived.flags.owndata
    assert np.array_equal(arrived, weights) and got.file_bytes(ADAPTER_WEIGHTS) == weights.tobytes()
