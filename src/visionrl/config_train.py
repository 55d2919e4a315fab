"""The `train:` section of a job: the optimizer and its schedule, the learner's micro-batches and kernels, its
ranks, and when a run stops on its own."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from visionrl.config_yaml import Section


class TrainConfig(Section):
    steps: int = Field(100, ge=1, le=10_000_000, description="GRPO steps (one rollout batch each).")
    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate of the LoRA weights.")
    merger_lr: float | None = Field(None, gt=0.0, description="Learning rate of merger LoRA (default: lr).")
    lm_head_lr: float | None = Field(None, gt=0.0, description="Learning rate of lm_head LoRA (default: lr).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up optimizer steps.")
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="After warm-up.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine decays to lr * min_lr_ratio.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping (global L2 norm).")
    micro_batch_tokens: int = Field(
        8192, ge=64, description="Token budget of one learner micro-batch (gradient accumulation above it)."
    )
    logprob_batch_tokens: int | None = Field(
        None,
        ge=64,
        description="Token budget of one micro-batch of the no-gradient passes (old and reference log-probs): "
        "they keep no activations, so larger batches fit; null: 16384 or micro_batch_tokens if larger "
        "(benchmarks/NOTES-gpu-learner.md).",
    )
    logit_chunk_tokens: int = Field(
        2048,
        ge=0,
        description="Completion tokens per lm_head chunk for log-probs and entropy (memory: chunk x vocab x "
        "4 bytes, recomputed in backward); 0: the whole micro-batch at once.",
    )
    share_images: bool = Field(
        True,
        description="Encode each distinct image of a learner micro-batch once (a group's completions share "
        "their prompt's images) instead of once per completion.",
    )
    packing: bool | Literal["auto"] = Field(
        "auto",
        description="Padding-free micro-batches: sequences end to end in rows of at most micro_batch_tokens "
        "(logprob_batch_tokens for the no-gradient passes), each with its own M-RoPE positions and attention "
        "that stays inside it (models.packing); the same log-probs as padded rows, without computing padding. "
        "auto: packed on a GPU, padded on the CPU (the README's Performance section: packed rows keep spread lengths at "
        "the equal-length speed).",
    )
    packed_attention: Literal["auto", "sdpa_mask", "varlen", "flex"] = Field(
        "auto",
        description="With packing: the attention of a packed row (models.packed_attention). varlen: torch's "
        "varlen_attn (CUDA, bf16/fp16), else flex; flex: FlexAttention with a document block mask; both fall "
        "back to sdpa_mask (SDPA with a dense document mask) with a warning; auto: varlen. On the CPU all but "
        "sdpa_mask are an exact per-sequence loop; flash_attention_2 models keep their own varlen path.",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer of the language model (dynamic shapes: one compilation "
        "for every micro-batch length), fusing the elementwise work around the matmuls; the first step pays "
        "the compilation. Not applied with FSDP2 (train.fsdp), where it is not measured yet.",
    )
    fsdp: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Shard base model and LoRA over the learner ranks with FSDP2. auto: when the learner runs on "
        "CUDA and ray.num_learners > 1, else plain data parallel (whole model per rank, gradients all-reduced); "
        "on: FSDP2 also for one rank; off: never.",
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0.0,
        description="The most GPU memory the learner may allocate, in GiB (torch's per-process memory fraction of "
        "its device): to share a GPU, or to run a smaller card's setting on a larger one (with "
        "rollout.gpu_memory_utilization scaled to the same GiB); null: the whole card.",
    )
    seed: int = Field(0, description="Seed of data order, sampling and LoRA init.")
    torch_threads: int | None = Field(
        None, ge=1, description="Learner torch threads (CPU); default: torch's."
    )
    target_accuracy: float | None = Field(
        None, gt=0.0, le=1.0, description="Stop early after two consecutive evals at or above this accuracy."
    )
    on_nonfinite: Literal["skip", "stop"] = Field(
        "skip",
        description="An update whose loss or gradient norm is NaN or infinite is never applied. skip: count it "
        "(faults/skipped_updates) and go on, stopping after max_consecutive_skips such steps in a row; stop: "
        "stop the run at the first one. Checkpoints keep the last applied (finite) adapter either way.",
    )
    max_consecutive_skips: int = Field(
        3,
        ge=1,
        description="Steps in a row without a usable update (every update skipped as non-finite, or a reward "
        "that failed on every sample) after which the run stops with the first errors shown.",
    )

    @field_validator("fsdp", mode="before")
    @classmethod
    def yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean: `fsdp: on` in a job file means "on".
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("betas")
    @classmethod
    def validate_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # AdamW's moving averages decay by beta per step: beta = 1 never forgets, beta < 0 is meaningless.
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each of train.betas must lie in [0, 1), e.g. [0.9, 0.999]")
        return betas
