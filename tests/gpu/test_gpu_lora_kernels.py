"""The LoRA kernel tuner on a real GPU: vLLM's own kernels timed at the job's shapes, every candidate's output
checked against a float32 matmul, and a tuned folder that is never slower than vLLM's default by its own timings."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_tuner_times_checks_and_writes_the_jobs_kernels(tmp_path) -> None:
    pytest.importorskip("vllm")
    from visionrl.rollout.lora_kernels import KernelTimer, default_config, job_shapes, tune, write_folder

    text = {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip
    shapes = [s for s in job_shapes(text, 64) if s.name in ("qkv_proj", "gate_up_proj")]
    timer = KernelTimer()
    fn = timer(shapes[0], 512)
    default = default_config(shapes[0].op, 512, shapes[0].slices)
    assert 0.5 < fn(default) < 5000  # microseconds for one kernel call
    rows = tune(shapes, [512], timer, passes=1, budget_s=120)
    assert len(rows) == len(shapes)
    for row in rows:
        assert row["tuned_us"] <= row["default_us"]
    files = write_folder(rows, tmp_path, timer.device_name)
    assert {p.name.rsplit("_", 1)[-1] for p in files} == {"SHRINK.json", "TRUE.json"}
    assert json.loads(files[0].read_text())["2"]["3"]["512"]
