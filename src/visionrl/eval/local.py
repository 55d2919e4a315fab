"""Local evaluation of a base model + LoRA adapter on the user's own visual benchmark (`visionrl eval`).

Evaluation is greedy decoding scored by the same rewards as training (`visionrl.eval.scoring`), written as
the shared report (`visionrl.eval.report`):

- `generate_answers(engine, prompts, ...)`: greedy answers from any object with `.generate(prompts, spec)`
  (the vLLM or HF rollout engine); `evaluate_prompts` scores them too (the training loop's periodic eval);
- `evaluate_local(...)`: the whole local run (data, processor, engine from the one engine factory,
  adapter, report).

A served model is evaluated by `visionrl.eval.endpoint` into the same report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from visionrl.adapter.files import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    check_weights_open,
    read_json_object,
    require_plain_lora,
    target_regex,
    targets_vision,
)
from visionrl.adapter.manifest import read_local_budget
from visionrl.adapter.resolve import resolve_adapter
from visionrl.config import LoraConfig, RolloutConfig
from visionrl.config_env import EnvConfig
from visionrl.data.images import ImageBudget
from visionrl.data.layouts import Layout
from visionrl.errors import InputError
from visionrl.eval.judged import Judges, check_judges_for, engine_judge, judge_step
from visionrl.eval.report import DEFAULT_REWARDS, EvalSettings
from visionrl.eval.scoring import score_generations
from visionrl.rewards import CombinedReward
from visionrl.rollout.factory import ENGINES, make_engine
from visionrl.rollout.vllm_platform import cpu_only
from visionrl.types import AdapterPayload, Completion, Generation, PromptItem, RolloutEngine, SamplingSpec

logger = logging.getLogger(__name__)

# What a rollout engine raises for a prompt it cannot serve (too long, an image it rejects, an internal
# engine error after its own retry). Such a prompt becomes a failed record; other exceptions are bugs.
GENERATION_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError)


class GenerateEngine(Protocol):
    """The one method evaluation needs from an engine (both rollout engines have it)."""

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]: ...


REJECTED = (
    "the engine rejected the prompt (too long for its context, or more images than it takes; see the log)"
)


def _from_group(group: list[Completion], latency_ms: float) -> Generation:
    """The answer of a prompt's group; a failed Generation for a prompt the engine rejected (no completion)."""
    if not group:
        return Generation(None, 0, latency_ms, None, REJECTED)
    completion = group[0]
    return Generation(completion.text, len(completion.token_ids), latency_ms, completion.finish_reason)


def _generate_batch(
    engine: GenerateEngine, batch: list[PromptItem], spec: SamplingSpec, clock: Callable[[], float]
) -> list[Generation]:
    """Greedy answers of one batch; if the batch fails, each prompt is retried alone to isolate the bad one."""
    start = clock()
    try:
        outputs = engine.generate(batch, spec)
    except GENERATION_ERRORS as err:
        logger.warning(
            "generation of a batch of %d failed (%s); retrying its prompts one by one", len(batch), err
        )
    else:
        per_sample_ms = (clock() - start) * 1000.0 / len(batch)
        return [_from_group(out, per_sample_ms) for out in outputs]
    generations = []
    for prompt in batch:
        start = clock()
        try:
            out = engine.generate([prompt], spec)[0]
        except GENERATION_ERRORS as err:
            generations.append(
                Generation(None, 0, (clock() - start) * 1000.0, None, f"{type(err).__name__}: {err}")
            )
        else:
            generations.append(_from_group(out, (clock() - start) * 1000.0))
    return generations


def generate_answers(
    engine: GenerateEngine,
    prompts: list[PromptItem],
    *,
    max_tokens: int,
    batch_size: int = 64,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Generation]:
    """Greedy answers of every prompt from `engine`, in batches, in prompt order.

    A prompt the engine cannot serve (it raises one of GENERATION_ERRORS) becomes a failed Generation with
    the error message; the others are still answered. `latency_ms` of a sample is its batch's wall time
    (measured with `clock`, in seconds) divided by the batch size.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    spec = SamplingSpec(n=1, greedy=True, max_tokens=max_tokens)
    generations: list[Generation] = []
    for start in range(0, len(prompts), batch_size):
        generations.extend(_generate_batch(engine, prompts[start : start + batch_size], spec, clock))
    return generations


def evaluate_prompts(
    engine: GenerateEngine,
    prompts: list[PromptItem],
    reward_fn: CombinedReward,
    *,
    max_tokens: int,
    batch_size: int = 64,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """Greedy-decode every prompt with `engine` (see `generate_answers`) and score the answers (see
    `score_generations`): a prompt the engine cannot serve is a failed record."""
    answers = generate_answers(engine, prompts, max_tokens=max_tokens, batch_size=batch_size, clock=clock)
    return score_generations(prompts, answers, reward_fn)


def _resolve_adapter(adapter: str | Path) -> Path:
    """The adapter folder `adapter` names (a run directory, a checkpoint, an export or a PEFT folder), its files
    checked against their manifest (`visionrl.adapter.resolve`), with weights that safetensors can open."""
    folder = resolve_adapter(adapter).path
    check_weights_open(folder)
    return folder


def _read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    cfg_path = adapter_dir / ADAPTER_CONFIG
    cfg = read_json_object(cfg_path, "adapter config")
    require_plain_lora(cfg, cfg_path)  # both engines rebuild the LoRA layout from r, lora_alpha and targets
    return cfg


def _engine_lora(engine: str, adapter_cfg: dict[str, Any] | None) -> LoraConfig:
    """The LoRA layout of the evaluation engine. Without an adapter the default LoRA has B = 0 (the model
    equals the base model). vLLM reads targets from the adapter and needs the rank and the merger flag; the
    HF engine builds its layout from the targets' regex, which already names the merger if trained."""
    if adapter_cfg is None:
        return LoraConfig()
    regex = target_regex(adapter_cfg["target_modules"])
    return LoraConfig(
        rank=adapter_cfg["r"],
        alpha=float(adapter_cfg["lora_alpha"]),
        target_modules=regex,
        train_merger=engine == "vllm" and targets_vision(regex),
    )


def _build_engine(
    engine: str,
    base: str,
    adapter_cfg: dict[str, Any] | None,
    forbidden: list[int],
    budget: ImageBudget,
    seed: int,
) -> RolloutEngine:
    """The rollout engine for local evaluation, from the engine factory training uses."""
    return make_engine(
        base,
        lora=_engine_lora(engine, adapter_cfg),
        rollout=RolloutConfig.model_validate({"engine": engine}),
        forbidden_token_ids=forbidden,
        dtype="float32" if cpu_only() else "bfloat16",  # bf16 is 4-20x slower on CPUs (docs/ENGINE_NOTES.md)
        seed=seed,
        budget=budget,
    )


def evaluate_local(
    base: str,
    adapter: str | None,
    data: str,
    out: str,
    engine: str = "vllm",
    ablate_images: bool = False,
    max_samples: int | None = None,
    max_tokens: int = 32,
    rewards: list[str] | None = None,
    seed: int = 0,
    budget: ImageBudget | None = None,
    layout: Layout | None = None,
    judges: Judges | None = None,
    env: EnvConfig | None = None,
) -> dict[str, Any]:
    """Evaluate `base` (+ `adapter`) on `data` with a local engine ("vllm" or "hf"); write and return the report.
    `judges` (`eval --judge`, `visionrl.eval.judged`) score the answers too: backend engine on this engine with
    the adapter off, the others after it is closed.

    Images are resized into `budget`; without one, into the budget the adapter was trained with (its
    manifest), else the default budget. A prompt the engine rejects is a failed record.

    With `env` (a job's `env` section) each prompt is played as one greedy multi-turn episode with that
    environment (in this process) and its final turn is the answer (`visionrl.eval.episodes`); the report's
    `episodes` holds the episodes' metrics.

    `rewards` are reward names (default ["exact_match"]), each of weight 1. Bad inputs (missing data file or
    adapter, unknown reward or engine, a base directory that is not a Qwen3-VL checkpoint) raise InputError
    before any model is loaded.
    """
    from transformers import AutoConfig

    from visionrl.data.dataset import load_dataset
    from visionrl.data.prompts import build_prompt
    from visionrl.models.loader import check_model_dir, load_processor, vision_token_ids

    if engine not in ENGINES:
        raise InputError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
    settings = EvalSettings(data, out, tuple(rewards or DEFAULT_REWARDS), max_tokens, seed, ablate_images)
    check_judges_for(judges or [], local=True)
    check_model_dir(base)
    adapter_dir = _resolve_adapter(adapter) if adapter else None
    adapter_cfg = _read_adapter_config(adapter_dir) if adapter_dir else None
    with settings.reward_fn() as reward_fn:
        budget = budget or (read_local_budget(adapter_dir) if adapter_dir else None) or ImageBudget()
        processor = load_processor(base, budget)
        samples = load_dataset(data, max_samples=max_samples, layout=layout)
        prompts = settings.prompts(
            [build_prompt(sample, processor, keep_source=env is not None) for sample in samples]
        )
        forbidden = vision_token_ids(AutoConfig.from_pretrained(base), processor)
        with closing(_build_engine(engine, base, adapter_cfg, forbidden, budget, seed)) as runner:
            if adapter_dir is not None:
                files = {name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}
                runner.load_adapter(AdapterPayload(version=1, files=files))
            # judges of backend engine first, on this engine; then it is closed for the others' models
            judge = judge_step(
                judges,
                (layout or Layout()).prompt_key,
                partial(engine_judge, runner, processor),
                runner.close,
            )
            episodes: dict[str, float] = {}  # the episodes' metrics, with `env`
            generate = _answers(runner, prompts, max_tokens, env, processor, episodes)
            return settings.report(
                prompts,
                generate,
                reward_fn,
                judge=judge,
                model=base if adapter_dir is None else f"{base} + {adapter_dir}",
                extra={
                    "base": base,
                    "adapter": None if adapter_dir is None else str(adapter_dir),
                    "engine": engine,
                    "images": budget.as_dict(),
                    **({"env": env.model_dump(mode="json"), "episodes": episodes} if env is not None else {}),
                },
            )


def _answers(
    engine: RolloutEngine,
    prompts: list[PromptItem],
    max_tokens: int,
    env: EnvConfig | None,
    processor: Any,
    metrics: dict[str, float],
) -> Callable[[], list[Generation]]:
    """What answers the prompts: greedy generation, or with `env` one greedy episode each (`_episodes`)."""
    if env is None:
        return partial(generate_answers, engine, prompts, max_tokens=max_tokens)
    return partial(_episodes, engine, prompts, env, processor, max_tokens, metrics)


def _episodes(
    engine: RolloutEngine,
    prompts: list[PromptItem],
    env: EnvConfig,
    processor: Any,
    max_tokens: int,
    metrics: dict[str, float],
) -> list[Generation]:
    """Greedy episodes with `env` in this process; their metrics put into `metrics`."""
    from visionrl.config_rollout import RolloutConfig
    from visionrl.envs.episodes import EpisodeRunner
    from visionrl.envs.pool import LocalEnvs
    from visionrl.eval.episodes import episode_answers

    runner = EpisodeRunner(env, processor, LocalEnvs(env), max_model_len=RolloutConfig().max_model_len)
    answers, got = episode_answers(engine, prompts, runner, max_tokens=max_tokens)
    metrics.update(got)
    return answers
