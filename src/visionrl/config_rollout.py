"""The `rollout:` section of a job: the engines, how they sample, and the bounds on their mismatch with the learner."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from visionrl.config_yaml import Section

LoraServing = Literal["adapter", "merged"]  # how adapter versions reach vLLM engines (rollout.vllm_adapters)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# vLLM engine arguments visionrl derives from the job: given in rollout.vllm_engine_args, they would silently
# disagree with the learner (dtype, lengths, images, LoRA shape, log-prob semantics); the key to set instead.
RESERVED_ENGINE_ARGS = {
    "model": "model.path", "dtype": "model.dtype", "max_model_len": "rollout.max_model_len",
    "seed": "seed", "logprobs_mode": "nothing: the mismatch guard needs processed log-probs",
    "mm_processor_kwargs": "data.min_pixels/max_pixels", "limit_mm_per_prompt": "data.max_images_per_prompt",
    "enforce_eager": "rollout.enforce_eager", "worker_extension_cls": "nothing: the adapter sync needs it",
    "enable_lora": "lora", "max_lora_rank": "lora.rank", "max_loras": "nothing: one adapter version is served",
    "enable_tower_connector_lora": "lora.train_merger", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "enable_sleep_mode": "rollout.sleep_during_update",
}  # fmt: skip


class RolloutConfig(Section):
    engine: Literal["vllm", "hf"] = Field(
        "vllm", description="Rollout engine: vLLM (default) or transformers generate."
    )
    prompts_per_step: int = Field(
        32, ge=1, le=100_000, description="Prompts per step; completions per step = prompts x group_size."
    )
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling. Below 1 the engine's log-probs are "
        "renormalised over the nucleus, the learner's are not: refused with algorithm.old_logprobs=engine.")  # fmt: skip
    max_new_tokens: int = Field(256, ge=1, le=1_048_576, description="Maximum tokens per completion.")
    num_engines: int = Field(1, ge=1, le=4096, description="Rollout engine actors (data-parallel).")
    gpus_per_engine: float = Field(0.0, ge=0.0, description="GPUs per engine actor (0 on CPU).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="vLLM: share of GPU memory for the engine."
    )
    max_model_len: int = Field(4096, ge=64, description="vLLM: longest prompt + completion.")
    enforce_eager: bool = Field(False, description="vLLM: no CUDA graphs (faster start, slower decode).")
    kv_cache_gib: float = Field(
        1.0, gt=0.0, description="vLLM CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    max_logprob_diff: float = Field(
        0.2,
        gt=0.0,
        description="Largest mean |engine - learner| log-prob per token (the same tokens under the same adapter "
        "version, before the update) before a warning; max_logprob_diff_steps such steps in a row stop the run: "
        "the engine is not sampling the policy being trained. Measured: 0.04 in bf16 on an H200, 1e-6 in float32.",
    )
    max_logprob_diff_steps: int = Field(
        3,
        ge=1,
        description="Consecutive steps over the bound (rollout mismatch), or syncs (an engine's fingerprint), "
        "that stop the run with an error.",
    )
    max_logprob_diff_ratio: float | None = Field(
        4.0,
        gt=1.0,
        description="A second, relative bound: after 5 steps, a mismatch (rollout or fingerprint) over this "
        "multiple of the median of the run's first 5 (and over 0.01) counts as over too; null: the absolute "
        "max_logprob_diff only. Catches a drift from the run's own level well below the absolute bound.",
    )
    sleep_during_update: bool = Field(
        False,
        description="vLLM on GPUs: put the engines to sleep (KV cache freed, weights to CPU memory) while the "
        "learner updates, so a colocated learner can use that memory; woken before the adapter sync.",
    )
    async_steps: int = Field(
        0,
        ge=0,
        le=1,
        description="0: synchronous steps. 1: one-step-off rollouts: the engines generate (and the reward workers "
        "score) the next step's batch with the adapter they hold while the learner trains this step, so each "
        "batch is at most one adapter version old (rollout/staleness). What accounts for that gap is the old "
        "policy: with algorithm.old_logprobs=engine (recommended) the ratio is taken against the sampling "
        "policy itself; with old_logprobs=learner the clip is centred on the learner's current policy and only "
        "the rollout correction weights the gap, so that pairing with rollout_correction=off is refused. "
        "Overlaps only where engines and learner do not share a device (split placement, CPUs).",
    )

    lora_serving: LoraServing = Field(
        "adapter",
        description="vLLM: how each adapter version reaches the engines. adapter: as a LoRA adapter, applied by "
        "vLLM's LoRA kernels to every request. merged: the engines run without LoRA and each version is merged "
        "into the weights it adapts (W0 + scale * B @ A, from the checkpoint's W0 kept in host memory, 14 GB per "
        "engine at 8B with LoRA on every projection): "
        "generation as fast as the base model's (LoRA's kernels cost the 8B job 22% of its generation), a "
        "longer sync, and the merged weights rounded to model.dtype. Both are checked by the same fingerprint. "
        "The HF engine applies the adapter with peft either way.",
    )
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="vLLM: more engine arguments (those of vllm.LLM / `vllm serve`), e.g. {max_num_seqs: 256, "
        "max_num_batched_tokens: 16384, max_cpu_loras: 2}: the scheduler and LoRA settings measured in "
        "benchmarks/NOTES-gpu-learner.md. The ones visionrl sets from other keys are refused here "
        "(RESERVED_ENGINE_ARGS): set those keys instead.",
    )

    vllm_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the engines' processes: vLLM reads some settings only there, e.g. "
        "{VLLM_LORA_ENABLE_DUAL_STREAM: 1} (LoRA's kernels on a second CUDA stream beside the base layer's; "
        "benchmarks/gpu_rollout.py measures it as dual_stream). Values are written as strings, true/false as 1/0.",
    )

    @field_validator("vllm_env", mode="before")
    @classmethod
    def env_as_strings(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        bad = [k for k in value if not isinstance(k, str) or not _ENV_NAME.fullmatch(k)]
        if bad:
            raise ValueError(
                f"rollout.vllm_env: {bad} are not environment variable names (letters, digits, _)"
            )
        return {k: ("1" if v else "0") if isinstance(v, bool) else str(v) for k, v in value.items()}

    @model_validator(mode="after")
    def validate_engine_args(self) -> RolloutConfig:
        taken = sorted(set(self.vllm_engine_args) & set(RESERVED_ENGINE_ARGS))
        if taken:
            listed = ", ".join(f"{k} (set {RESERVED_ENGINE_ARGS[k]})" for k in taken)
            raise ValueError(f"rollout.vllm_engine_args sets what visionrl sets itself: {listed}")
        return self

    @model_validator(mode="after")
    def validate_async_without_sleep(self) -> RolloutConfig:
        if self.async_steps and self.sleep_during_update:
            raise ValueError(
                f"rollout.async_steps={self.async_steps} has the engines generate the next batch while the learner "
                "trains, but rollout.sleep_during_update puts them to sleep during the update; set "
                "rollout.sleep_during_update=false (and give engines their own GPUs: ray.placement=split), or "
                "rollout.async_steps=0"
            )
        return self
