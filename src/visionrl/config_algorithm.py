"""The `algorithm` section of the job file: the GRPO variant (advantages, clipping, loss, KL, rollout correction,
shaping). Part of `visionrl.config`, which re-exports it; kept apart so that no config module grows too long."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from visionrl.config_yaml import Section


class AlgorithmConfig(Section):
    group_size: int = Field(
        8, ge=2, le=1024, description="Completions sampled per prompt (G); advantages are group-relative."
    )
    advantage_scale: Literal["std", "none"] = Field(
        "std", description="'std': GRPO (r-mean)/(std+advantage_std_eps); 'none': Dr. GRPO r-mean."
    )
    advantage_std_eps: float = Field(
        1e-6,
        ge=0.0,
        le=10.0,
        description="Added to a group's reward std before dividing (advantage_scale std). With a model's score as "
        "the reward (a judge's P(yes)), a floor such as 0.1 keeps small differences between equally wrong answers "
        "from becoming full-size advantages.",
    )
    clip_low: float | None = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Ratio clip below 1 (1 - clip_low). null: no lower bound, for loss cispo only, and its "
        "default there (MiniMax-M1's CISPO bounds the weight above only).",
    )
    clip_high: float = Field(
        0.2, ge=0.0, description="PPO ratio clip above 1 (1 + clip_high); DAPO clip-higher uses 0.28."
    )
    dual_clip: float | None = Field(
        None,
        gt=1.0,
        description="Dual-clip constant c (>1): the loss of a negative-advantage token is capped at -A*c (ppo). "
        "Default 3.0 with old_logprobs engine (a token the engine sampled at -7.0 and the learner scores at -4.5 "
        "has ratio 12 and would weigh 12x), else null (off).",
    )
    loss_aggregation: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = Field(
        "token_mean",
        description="How per-token losses become one number (Dr. GRPO: seq_mean_token_sum_norm). Default "
        "seq_mean_token_mean with loss gspo (its objective is per sequence; token_mean weights sequences by "
        "length), else token_mean.",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, description="Weight of the KL penalty to the base model (adapter disabled)."
    )
    kl_kind: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator per token.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (subtracted from the loss).")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling: train only on groups whose rewards differ (the others carry no signal), "
        "sampling more prompts (up to max_sampling_rounds batches) to fill the step. The filter reads the rewards "
        "before the overlong shaping, as DAPO filters on accuracy: a group that differs only in its length "
        "penalty is dropped.",
    )
    max_sampling_rounds: int = Field(
        3, ge=1, description="With dynamic_sampling: batches of prompts sampled per step, at most."
    )
    updates_per_batch: int = Field(1, ge=1, description="Optimizer steps per rollout batch (mini-batches).")
    old_logprobs: Literal["learner", "engine"] = Field(
        "learner",
        description="The old policy of the ratio. learner: the learner's own log-probs before the step's first "
        "update (a no-grad pass over the mini-batches after the first; the first is on-policy, ratio 1); engine: "
        "the engine's sampling log-probs, which skips that pass (the ratio then also carries the engine/learner "
        "mismatch, so rollout_correction must be off).",
    )
    loss: Literal["ppo", "gspo", "cispo", "sapo"] = Field(
        "ppo",
        description="Policy loss: ppo (token ratio, clipped), gspo (sequence ratio, clipped; use a small clip "
        "range, e.g. clip_low 3e-4, clip_high 4e-4), cispo (clipped ratio as a coefficient; clipped tokens keep "
        "their gradient), sapo (a soft sigmoid gate instead of the clip).",
    )
    tau_pos: float = Field(1.0, gt=0.0, description="sapo: gate temperature for positive advantages.")
    tau_neg: float = Field(1.05, gt=0.0, description="sapo: gate temperature for negative advantages.")
    rollout_correction: Literal["off", "token", "sequence"] = Field(
        "token",
        description="Importance weights for the engine/learner mismatch (learner old log-probs vs the engine's "
        "sampling log-probs) on the policy loss: per token, per sequence, or off. On by default: truncated at "
        "correction_threshold, it only down-weights tokens the engine over-sampled.",
    )
    correction_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: weights capped at correction_threshold (truncated IS); mask: tokens whose weight "
        "lies outside [correction_lower, correction_threshold] are left out of the loss and of its normalisers "
        "(decided before the update, from one no-grad pass of the learner over every row).",
    )
    correction_threshold: float = Field(2.0, gt=1.0, description="Upper bound of the correction weights.")
    correction_lower: float = Field(0.5, gt=0.0, lt=1.0, description="correction_mode mask: the lower bound.")
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="DAPO overlong shaping: completions longer than max_new_tokens - buffer get a reward penalty "
        "rising linearly to -overlong_factor at max_new_tokens (null: off).",
    )
    overlong_factor: float = Field(1.0, gt=0.0, description="The overlong penalty at max_new_tokens.")
    mask_truncated: bool = Field(
        False,
        description="Leave completions cut at max_new_tokens out of the loss (they still count in their group's "
        "advantages).",
    )

    @model_validator(mode="before")
    @classmethod
    def auto_defaults_of_the_loss(cls, data: Any) -> Any:
        # Defaults that depend on the loss and the old policy, for keys the job file leaves out; a value the
        # job file gives is kept as it is.
        if not isinstance(data, dict):
            return data
        loss, old = data.get("loss", "ppo"), data.get("old_logprobs", "learner")
        derived: dict[str, Any] = {}
        if loss == "cispo":
            derived["clip_low"] = None
        if loss == "gspo":
            derived["loss_aggregation"] = "seq_mean_token_mean"
        if loss == "ppo" and old == "engine":
            derived["dual_clip"] = 3.0
        return {**derived, **data}

    @model_validator(mode="after")
    def validate_no_lower_bound_only_for_cispo(self) -> AlgorithmConfig:
        if self.clip_low is None and self.loss != "cispo":
            raise ValueError(
                f"algorithm.clip_low=null (no lower bound) is for loss cispo only; with loss {self.loss} a "
                "negative-advantage token would be pushed down without limit: set algorithm.clip_low (0.2 is usual)"
            )
        return self

    @field_validator("rollout_correction", mode="before")
    @classmethod
    def auto_correction_off_from_yaml_false(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: `rollout_correction: off` means the option named "off".
        return "off" if value is False else value

    @model_validator(mode="after")
    def engine_old_logprobs_need_no_correction(self) -> AlgorithmConfig:
        if self.old_logprobs == "engine" and self.rollout_correction != "off":
            raise ValueError(
                "algorithm.old_logprobs=engine takes the engine's sampling log-probs as the old policy, so the "
                "ratio already corrects for the engine; the rollout-correction weights (learner old over engine) "
                f"have nothing to compare: set algorithm.rollout_correction=off (it is {self.rollout_correction!r})"
            )
        return self
