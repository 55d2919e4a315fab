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
    assert variant_overrides("adapter") == ["rollout.lora_serving=adapter"]
    assert variant_overrides("merged") == ["rollout.lora_serving=merged"]
    assert variant_overrides("seqs_512") == ["rollout.vllm_engine_args={max_num_seqs: 512}"]
    assert variant_overrides("tokens_16384") == ["rollout.vllm_engine_args={max_num_batched_tokens: 16384}"]
    assert variant_overrides("share_0.5") == ["rollout.gpu_memory_utilization=0.5"]
    assert variant_overrides("lora_graphs") == [
        "rollout.lora_serving=adapter",
        "rollout.vllm_engine_args={compilation_config: {cudagraph_specialize_lora: false}}",
    ]
    assert all(isinstance(variant_overrides(v), list) for v in VARIANTS)  # the default list is all valid
    with pytest.raises(SystemExit, match="unknown variant 'fast'"):
        variant_overrides("fast")


def test_the_overrides_load_into_the_production_job() -> None:
    from visionrl.config import load_config

    job = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_8b_grpo_lora.yaml"
    cfg = load_config(job, variant_overrides("seqs_512") + variant_overrides("share_0.5"))
    assert cfg.rollout.vllm_engine_args == {"max_num_seqs": 512} and cfg.rollout.gpu_memory_utilization == 0.5
    assert load_config(job).rollout.lora_serving == "merged"  # the job as shipped
    assert load_config(job, variant_overrides("merged")).rollout.lora_serving == "merged"
    # the variants that measure vLLM's LoRA kernels serve the adapter through them
    for name in ("adapter", "tuned_lora", "lora_specialize", "lora_graphs", "dual_stream"):
        assert load_config(job, variant_overrides(name)).rollout.lora_serving == "adapter", name


def test_the_lora_graphs_variant_reaches_the_engine_as_vllm_reads_it() -> None:
    from visionrl.config import load_config

    job = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_8b_grpo_lora.yaml"
    cfg = load_config(job, variant_overrides("lora_graphs"))
    assert cfg.rollout.vllm_engine_args == {"compilation_config": {"cudagraph_specialize_lora": False}}


def test_the_dual_stream_variant_is_the_engines_environment_not_the_job() -> None:
    assert variant_overrides("dual_stream") == ["rollout.lora_serving=adapter"]
    assert VARIANT_ENV["dual_stream"] == {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}
    assert set(VARIANT_ENV) <= set(VARIANTS)


def test_a_row_says_whether_this_vllm_reads_the_variants_environment(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The CPU build here (vLLM 0.32) knows the dual-stream variable; a name it lacks is reported as unknown; and
    whether vLLM in this process reads each value the variant set (its engine core inherits the environment)."""
    pytest.importorskip("vllm")
    import gpu_rollout
    import vllm.envs

    # as after an engine's start in this process (another test's, before this one): vLLM's cache of its variables
    if not vllm.envs._is_envs_cache_enabled():
        vllm.envs.enable_envs_cache()
        request.addfinalizer(vllm.envs.disable_envs_cache)
    _ = vllm.envs.VLLM_TUNED_CONFIG_FOLDER  # cached unset

    assert gpu_rollout.known_env(VARIANT_ENV["dual_stream"]) == {"VLLM_LORA_ENABLE_DUAL_STREAM": True}
    assert gpu_rollout.known_env({}) == {}
    assert gpu_rollout.known_env({"VLLM_NOT_A_SETTING": "1"}) == {"VLLM_NOT_A_SETTING": False}
    folder = {"VLLM_TUNED_CONFIG_FOLDER": "/kernels"}
    assert gpu_rollout.seen_env(folder) == {"VLLM_TUNED_CONFIG_FOLDER": False}  # not in this environment
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", "/kernels")
    monkeypatch.setenv("VLLM_LORA_ENABLE_DUAL_STREAM", "1")
    assert gpu_rollout.seen_env({**folder, **VARIANT_ENV["dual_stream"]}) == {
        "VLLM_TUNED_CONFIG_FOLDER": True,
        "VLLM_LORA_ENABLE_DUAL_STREAM": True,  # a flag: vLLM reads "1" as True
    }


def test_the_lora_variants_are_settings_of_the_job() -> None:
    from visionrl.config import load_config

    # its folder is set where it is tuned, in the variant's process
    assert variant_overrides("tuned_lora") == ["rollout.lora_serving=adapter"]
    job = Path(__file__).resolve().parents[2] / "configs" / "qwen3vl_8b_grpo_lora.yaml"
    cfg = load_config(job, variant_overrides("lora_specialize"))
    assert cfg.rollout.vllm_engine_args == {"specialize_active_lora": True}


def test_greedy_agreement_counts_tokens_up_to_the_first_divergence() -> None:
    from gpu_rollout import greedy_agreement

    job = {
        "greedy": [{"tokens": [1, 2, 4], "logprobs": [-1.5, -2.0, -3.0]}, {"tokens": [7], "logprobs": [-1.0]}]
    }
    row = {
        "greedy": [{"tokens": [1, 2, 3], "logprobs": [-1.0, -2.0, -3.0]}, {"tokens": [7], "logprobs": [-1.0]}]
    }
    # 3 of the job's 4 tokens come before a divergence; their |differences| are 0.5, 0 and 0
    assert greedy_agreement(row, job) == {"same_prefix_share": 0.75, "mean_abs_logprob_diff": 0.5 / 3}
