"""benchmarks/gpu_rollout.py's variants: each name gives the job-file overrides it says, and a bad name is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from gpu_rollout import VARIANT_ENV, VARIANTS, variant_overrides


def test_each_variant_is_one_engine_setting() -> None:
    assert (
        variant_overrides("job") == variant_overrides("no_lora") == []
    )  # no_lora: the engine's rank, not the job
    assert variant_overrides("seqs_512") == ["rollout.vllm_engine_args={max_num_seqs: 512}"]
    assert variant_overrides("tokens_16384") == ["rollout.vllm_engine_args={max_num_batched_tokens: 16384}"]
    assert variant_overrides("share_0.5") == ["rollout.gpu_memory_utilization=0.5"]
    assert variant_overrides("lora_graphs") == [
        "rollout.vllm_engine_args={compilation_config: {cudagraph_specialize_lora: false}}"
    ]
    assert all(isinstance(variant_overrides(v), list) for v in VARIANTS)  # the default list is all valid
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        variant_overrides("fast")


def test_the_overrides_load_into_the_production_job() -> None:
    from visionrl.config import load_config

    job = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_8b_grpo_lora.yaml"
    cfg = load_config(job, variant_overrides("seqs_512") + variant_overrides("share_0.5"))
    assert cfg.rollout.vllm_engine_args == {"max_num_seqs": 512} and cfg.rollout.gpu_memory_utilization == 0.5


def test_the_lora_graphs_variant_reaches_the_engine_as_vllm_reads_it() -> None:
    from visionrl.config import load_config

    job = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_8b_grpo_lora.yaml"
    cfg = load_config(job, variant_overrides("lora_graphs"))
    assert cfg.rollout.vllm_engine_args == {"compilation_config": {"cudagraph_specialize_lora": False}}


def test_the_dual_stream_variant_is_the_engines_environment_not_the_job() -> None:
    assert variant_overrides("dual_stream") == []
    assert VARIANT_ENV["dual_stream"] == {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}
    assert set(VARIANT_ENV) <= set(VARIANTS)


def test_a_row_says_whether_this_vllm_reads_the_variants_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU build here (vLLM 0.32) knows the dual-stream variable; a name it lacks is reported as unknown."""
    pytest.importorskip("vllm")
    import gpu_rollout

    assert gpu_rollout.known_env("dual_stream") == {"VLLM_LORA_ENABLE_DUAL_STREAM": True}
    assert gpu_rollout.known_env("job") == {}
    monkeypatch.setitem(gpu_rollout.VARIANT_ENV, "job", {"VLLM_NOT_A_SETTING": "1"})
    assert gpu_rollout.known_env("job") == {"VLLM_NOT_A_SETTING": False}


def test_the_results_so_far_are_each_against_the_jobs_engine() -> None:
    """After each variant the file is written again: 14,000 against the job's 15,000 is 0.9333; a failed variant
    and one measured before the job's engine carry no ratio until the job's row is in."""
    import argparse

    import gpu_rollout

    args = argparse.Namespace(size="64x8x512", overrides=["rollout.gpu_memory_utilization=0.9"])
    dual = {"variant": "dual_stream", "generated_tokens_per_s": 14000.0}
    first = gpu_rollout.report_of([dual], args)
    assert "vs_job" not in first["results"][0] and first["setup"]["overrides"] == args.overrides
    rows = [dual, {"variant": "job", "generated_tokens_per_s": 15000.0}, {"variant": "x", "status": "failed"}]
    got = gpu_rollout.report_of(rows, args)["results"]
    assert [r.get("vs_job") for r in got] == [pytest.approx(14000 / 15000), 1.0, None]
