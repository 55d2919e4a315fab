"""Typed job configuration: one YAML file (plus `a.b=value` overrides) describes a whole training job.

The config is the single source of truth. Unknown keys, wrong types and inconsistent values fail with a
`ConfigError` whose message names the key, the problem and the fix; nothing is silently rewritten.
Each rule is one validator that raises, named `validate_*`; nothing here derives or fixes values behind the
user's back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from visionrl.config_algorithm import AlgorithmConfig
from visionrl.config_env import EnvConfig
from visionrl.config_logging import LoggingConfig
from visionrl.config_placement import PlacementPlan, plan_placement
from visionrl.config_ray import RayConfig
from visionrl.config_rollout import RolloutConfig
from visionrl.config_train import TrainConfig
from visionrl.config_yaml import ConfigError, Section, UniqueKeyLoader, apply_overrides
from visionrl.data.images import DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from visionrl.rewards.judge import JUDGE, JudgeSpec, judge_template
from visionrl.rewards.registry import RewardConfigError, RewardSpec, resolve_reward

# Default LoRA targets: the language model's projections only (never the vision blocks, whose
# `mlp.linear_fc1/fc2` names would also match a bare suffix).
LM_PROJECTIONS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
# The vision->language merger: Qwen3-VL's `linear_fc1/fc2` (and its deepstack mergers), Qwen2.5-VL's `mlp.0/2`.
# vLLM applies LoRA there only with `enable_tower_connector_lora=True` (docs/ENGINE_NOTES.md).
MERGER_PROJECTIONS = (
    r".*visual\.((merger|deepstack_merger_list\.\d+)\.(linear_fc1|linear_fc2)|merger\.mlp\.(0|2))"
)


class ModelConfig(Section):
    path: str = Field(
        description="Base model: a Qwen3-VL or Qwen2.5-VL checkpoint directory (or hub id where hubs are reachable)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "bfloat16",
        description="Weights and compute dtype; use float32 on CPU (bf16 is 4-20x slower on AVX2).",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Learner attention kernel."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (saves memory)."
    )
    checkpoint_layers: int | None = Field(
        None,
        ge=0,
        description="With gradient_checkpointing: recompute only the first N decoder layers (null: all). Each "
        "layer left out keeps its activations (memory) and saves one forward of it (time).",
    )


class LoraConfig(Section):
    rank: int = Field(16, ge=1, le=512, description="LoRA rank r.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: str | list[str] = Field(
        LM_PROJECTIONS,
        description="Regex (full match on module names) or list of module-name suffixes that get LoRA.",
    )
    train_merger: bool = Field(
        False,
        description="Also put LoRA on the vision->language merger (served by vLLM with tower/connector LoRA).",
    )
    train_lm_head: bool = Field(
        False, description="Also put LoRA on lm_head (vLLM supports it as a LoRA target)."
    )
    init_lora_weights: Literal["default", "gaussian"] = Field(
        "default", description="peft init of A (B is always zero, so step 0 equals the base model)."
    )


class RewardConfig(Section):
    name: str = Field(
        description="A built-in reward (exact_match, choice, numeric, format, iou), 'judge' (a model scores the "
        "completions: README, Rewards) or 'pkg.module:function'."
    )
    weight: float = Field(
        1.0, ge=-1e6, le=1e6, description="Weight in the total reward (weighted sum), within +-1e6."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the reward function."
    )


class DataConfig(Section):
    train: str = Field(
        description="Training data: JSONL or Parquet file (records with images, messages/prompt, answer)."
    )
    eval: str | None = Field(None, description="Held-out data for periodic evaluation (greedy decoding).")
    on_bad_image: Literal["error", "skip"] = Field(
        "error",
        description="An image that is missing, empty or does not fully decode at load: stop with an error, or "
        "skip the record and count it. An image that fails later, mid-run, is always skipped and counted.",
    )
    prompt_key: str = Field(
        "prompt",
        min_length=1,
        description="Field holding the prompt text when a record has no 'messages' (EasyR1/Geometry3K: "
        "'problem'); '<image>' markers in it place the images, else they go before the text.",
    )
    answer_key: str = Field(
        "answer", min_length=1, description="Field holding the reference answer the rewards compare against."
    )
    image_key: str = Field(
        "images",
        min_length=1,
        description="Field holding the images: a list (or one) of paths, base64 data URIs, bytes or "
        "{bytes, path} structs (Hugging Face-style parquet with one image per row: 'image').",
    )
    max_eval_samples: int | None = Field(
        None, ge=1, description="Evaluate on at most this many held-out records."
    )
    balance_key: str | None = Field(
        None, description="Balance each batch of prompts over this record field (e.g. 'answer')."
    )
    system_prompt: str | None = Field(None, description="Optional system message prepended to every prompt.")
    min_pixels: int = Field(
        DEFAULT_MIN_PIXELS,
        ge=1,
        description="Smallest image area in pixels: smaller images are enlarged (aspect ratio kept) to reach it. "
        "Applied the same way by the learner, the engines, evaluation and the served model.",
    )
    max_pixels: int = Field(
        DEFAULT_MAX_PIXELS,
        ge=1,
        description="Largest image area in pixels: larger images are shrunk (aspect ratio kept, sides on the "
        "processor's patch grid). One image token per (patch x merge)^2 pixels: 1,048,576 is at most 1,024 "
        "tokens for Qwen3-VL. Applied the same way everywhere min_pixels is.",
    )
    max_images_per_prompt: int = Field(
        DEFAULT_MAX_IMAGES,
        ge=1,
        description="Most images one record may hold; the engines and the server accept this many. Records "
        "with more are skipped at load, counted and listed in the log.",
    )

    @model_validator(mode="after")
    def validate_pixel_bounds(self) -> DataConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"data.min_pixels={self.min_pixels} is above data.max_pixels={self.max_pixels}; images are "
                "resized into [min_pixels, max_pixels], so set min_pixels <= max_pixels"
            )
        return self


class JobConfig(Section):
    """A whole GRPO job. See configs/*.yaml for commented examples."""

    output_dir: str = Field(
        min_length=1, description="Run directory: tensorboard/, checkpoints/, adapter/, eval/."
    )
    model: ModelConfig
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig
    rewards: list[RewardConfig] = Field(
        description="Reward functions; total = weighted sum (episodes: of the final turn, plus the env's step "
        "rewards; `rewards: []` for the env's alone)."
    )
    env: EnvConfig | None = Field(None, description="Multi-turn episodes (visionrl.envs); none: one turn.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    resume: bool | Literal["auto"] = Field(
        False,
        description="false: start fresh (refused if output_dir holds checkpoints); true: continue from the "
        "newest complete checkpoint; 'auto': continue if there is one, else start fresh (for jobs a scheduler "
        "re-runs after preemption). `visionrl train --resume [auto]` overrides it.",
    )

    # Each rule is its own validator that raises (named validate_*); none of them changes a value.

    @model_validator(mode="after")
    def validate_some_reward_counts(self) -> JobConfig:
        if not self.rewards and self.env is None:
            raise ValueError(
                "rewards: list at least one reward (`rewards: []` only with an env, whose steps reward)"
            )
        if self.rewards and all(r.weight == 0 for r in self.rewards) and self.env is None:
            raise ValueError(
                "every reward has weight 0, so every completion scores 0 and no group has a signal to train on; "
                "give at least one reward (rewards[].weight) a non-zero weight"
            )
        return self

    @model_validator(mode="after")
    def validate_updates_divide_the_step(self) -> JobConfig:
        completions = self.rollout.prompts_per_step * self.algorithm.group_size
        if completions % self.algorithm.updates_per_batch != 0:
            raise ValueError(
                f"algorithm.updates_per_batch={self.algorithm.updates_per_batch} must divide the "
                f"{completions} completions of a step (rollout.prompts_per_step x algorithm.group_size); "
                "choose a divisor, e.g. 1"
            )
        return self

    @model_validator(mode="after")
    def validate_mini_batches_hold_whole_groups(self) -> JobConfig:
        completions = self.rollout.prompts_per_step * self.algorithm.group_size
        if completions // self.algorithm.updates_per_batch % self.algorithm.group_size != 0:
            raise ValueError(
                "each mini-batch must hold whole groups: rollout.prompts_per_step must be divisible by "
                f"algorithm.updates_per_batch ({self.rollout.prompts_per_step} % {self.algorithm.updates_per_batch} != 0)"
            )
        return self

    @model_validator(mode="after")
    def validate_room_for_the_prompt(self) -> JobConfig:
        if self.rollout.max_new_tokens >= self.rollout.max_model_len:
            raise ValueError(
                f"rollout.max_new_tokens={self.rollout.max_new_tokens} leaves no room for the prompt in "
                f"rollout.max_model_len={self.rollout.max_model_len}; raise max_model_len or lower max_new_tokens"
            )
        return self

    @model_validator(mode="after")
    def validate_overlong_buffer_fits(self) -> JobConfig:
        buffer = self.algorithm.overlong_buffer
        if buffer is not None and buffer > self.rollout.max_new_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer={buffer} is longer than rollout.max_new_tokens="
                f"{self.rollout.max_new_tokens}; the penalty starts at max_new_tokens - buffer, so set a buffer "
                "of at most max_new_tokens (DAPO used a quarter of it)"
            )
        return self

    @model_validator(mode="after")
    def validate_gspo_without_dual_clip(self) -> JobConfig:
        if self.algorithm.loss != "ppo" and self.algorithm.dual_clip is not None:
            raise ValueError(
                f"algorithm.dual_clip applies to the ppo loss only, not to algorithm.loss={self.algorithm.loss}; "
                "set algorithm.dual_clip=null"
            )
        return self

    @model_validator(mode="after")
    def validate_stale_batches_have_an_old_policy(self) -> JobConfig:
        a = self.algorithm
        if self.rollout.async_steps and a.old_logprobs == "learner" and a.rollout_correction == "off":
            raise ValueError(
                f"rollout.async_steps={self.rollout.async_steps} trains batches sampled by the previous adapter "
                "version, but algorithm.old_logprobs=learner centres the clip on the learner's current policy and "
                "algorithm.rollout_correction=off leaves the gap to the sampling policy unweighted (such runs fell "
                "back to chance on 3 of 3 seeds); set algorithm.old_logprobs=engine (the ratio is then taken "
                "against the policy that sampled), or algorithm.rollout_correction=token, or rollout.async_steps=0"
            )
        return self

    @model_validator(mode="after")
    def validate_engine_old_policy_samples_the_full_softmax(self) -> JobConfig:
        if self.algorithm.old_logprobs == "engine" and self.rollout.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p={self.rollout.top_p} has the engine return log-probs renormalised over the nucleus, "
                "but the learner's log-probs are over the full vocabulary, so with algorithm.old_logprobs=engine "
                "every ratio is biased below 1 (tokens look less likely to the learner than they were sampled); "
                "set rollout.top_p=1.0, or algorithm.old_logprobs=learner with algorithm.rollout_correction=token"
            )
        return self

    @model_validator(mode="after")
    def validate_sleep_only_when_colocated(self) -> JobConfig:
        if self.rollout.sleep_during_update and self.ray.placement == "split":
            raise ValueError(
                "rollout.sleep_during_update frees the engines' GPU memory for a learner on the same GPUs, but "
                "ray.placement=split gives them GPUs of their own; set rollout.sleep_during_update=false"
            )
        return self

    def reward_specs(self, judges: bool = True) -> list[RewardSpec]:
        """The job's rewards in the job file's order; without `judges`, the rule rewards only (built-ins and user
        functions, which the reward workers score; judges score in batches: `orchestrate.judging`)."""
        return [
            RewardSpec(name=r.name, weight=r.weight, kwargs=dict(r.kwargs))
            for r in self.rewards
            if judges or r.name != JUDGE
        ]

    def placement_plan(self) -> PlacementPlan:
        """Which placement-group bundle each learner rank and engine of this job goes to."""
        r, ro = self.ray, self.rollout
        return plan_placement(r.placement, r.num_learners, r.learner_gpus, ro.num_engines, ro.gpus_per_engine)

    @model_validator(mode="after")
    def validate_placement(self) -> JobConfig:
        self.placement_plan()  # refuses the combinations that cannot be placed (visionrl.config_placement)
        return self

    @model_validator(mode="after")
    def validate_target_accuracy_has_eval_data(self) -> JobConfig:
        if self.train.target_accuracy is not None and self.data.eval is None:
            raise ValueError(
                f"train.target_accuracy={self.train.target_accuracy} stops on held-out accuracy, but data.eval is "
                "not set, so there is none; set data.eval to a held-out file, or remove train.target_accuracy"
            )
        return self

    @model_validator(mode="after")
    def validate_rewards_resolve(self) -> JobConfig:
        # Resolving imports user functions and binds kwargs, so an unknown name, a module that does not
        # import or a keyword the function does not take fails here, before Ray or any model starts.
        # A judge's keys and its template file (readable, placeholders known) are checked here too.
        for i, reward in enumerate(self.rewards):
            try:
                if reward.name == JUDGE:
                    judge_template(JudgeSpec.from_kwargs(reward.kwargs))
                else:
                    resolve_reward(
                        RewardSpec(name=reward.name, weight=reward.weight, kwargs=dict(reward.kwargs))
                    )
            except (RewardConfigError, ValueError) as err:
                raise ValueError(f"rewards[{i}]: {err}") from None
        return self


# --------------------------------------------------------------------------------------------------
# Loading


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: {err.error_count()} problem(s) in the job config:"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        kind = e["type"]
        if kind == "extra_forbidden":
            lines.append(
                f"  - {key}: unknown key; check the spelling (run `visionrl validate --schema` for all keys)"
            )
        elif kind == "missing":
            lines.append(f"  - {key}: required key is missing; add it to the job file")
        elif kind == "finite_number":
            lines.append(
                f"  - {key}: must be a finite number (got {e.get('input')!r}): NaN or infinity would make every "
                "loss non-finite; write a number such as 1e-5"
            )
        elif not e["loc"]:
            # A cross-field check: its message names the keys itself; the input would be the whole file.
            lines.append(f"  - {e['msg'].removeprefix('Value error, ')}")
        else:
            got = e.get("input")
            shown = repr(got) if not isinstance(got, dict) else "{...}"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"  - {key}: {msg} (got {shown})")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job file, apply `key=value` overrides, validate. Raises ConfigError."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"job file '{p}' does not exist; pass the path of a YAML job file (see configs/)")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        kind = "UTF-16 text" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "not UTF-8 text"
        raise ConfigError(
            f"{p}: {kind} (byte 0x{raw[err.start]:02x} at position {err.start}); a job file is YAML in UTF-8: "
            "save it as UTF-8, or check that the path names the job file and not a binary"
        ) from None
    if "\x00" in text:
        raise ConfigError(f"{p}: holds NUL bytes, so it is a binary file, not a YAML job file (see configs/)")
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except RecursionError:
        raise ConfigError(
            f"{p}: nested too deeply to read (thousands of levels); a job file has sections of plain keys"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{p}: not valid YAML{where}: {problem}; fix the syntax") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p}: the top level must be a mapping of sections (model:, data:, ...), got {type(data).__name__}"
        )
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data, source=str(p))


def dump_config(cfg: JobConfig) -> str:
    """The resolved config as YAML (every key, defaults included)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
