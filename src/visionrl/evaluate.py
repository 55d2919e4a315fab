"""Evaluation of a base model + LoRA adapter on the user's own visual benchmark (`visionrl eval`).

Evaluation is greedy decoding scored by the same rewards as training. It is split in layers so that every
way of producing answers shares one scoring and one report:

- `evaluate_prompts(engine, prompts, reward_fn, ...)`: greedy answers from any object with
  `.generate(prompts, spec)` (the vLLM or HF rollout engine; the training loop uses it for periodic eval);
- `score_generations(prompts, generations, reward_fn)`: backend-agnostic scoring of `Generation`s (what an
  endpoint evaluation produces from HTTP responses goes through here too);
- `summarize(...)` and `write_report(...)`: the report JSON and its Markdown twin (`visionrl.eval_report`,
  re-exported here);
- `evaluate_local(...)`: the whole local run (data, processor, engine, adapter, report);
- `evaluate_endpoint(...)`: the same report for a served model, through its OpenAI-compatible chat API
  (`visionrl.endpoint_client` sends the requests).

`ablate(prompts, seed)` permutes images across samples: if accuracy stays up without the right image, the
model answers from the text alone.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from visionrl.errors import InputError
from visionrl.eval_report import HEADLINE as HEADLINE
from visionrl.eval_report import MARKDOWN_SAMPLES as MARKDOWN_SAMPLES
from visionrl.eval_report import nearest_rank as nearest_rank
from visionrl.eval_report import render_markdown as render_markdown
from visionrl.eval_report import summarize, write_report
from visionrl.rewards import CombinedReward, RewardSpec, build_reward_fn
from visionrl.rollout.types import (
    ADAPTER_FILES,
    ADAPTER_WEIGHTS,
    AdapterPayload,
    Completion,
    PromptItem,
    SamplingSpec,
)

logger = logging.getLogger(__name__)

# What a rollout engine raises for a prompt it cannot serve (too long, an image it rejects, an internal
# engine error after its own retry). Such a prompt becomes a failed record; other exceptions are bugs.
GENERATION_ERRORS: tuple[type[Exception], ...] = (RuntimeError, ValueError)
ENGINES = ("vllm", "hf")


class GenerateEngine(Protocol):
    """The one method evaluation needs from an engine (both rollout engines have it)."""

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]: ...


@dataclass
class Generation:
    """One prompt's answer from any backend, before scoring.

    `text` is None when the request or generation failed, and `error` then says why. `latency_ms` is the
    time this answer took (for batched local generation: the batch's wall time divided by its size).
    """

    text: str | None
    num_tokens: int = 0
    latency_ms: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


# --------------------------------------------------------------------------- scoring


def positive_weight(reward_fn: CombinedReward) -> float:
    """Sum of the positive reward weights: the best total when every reward lies in [0, 1]."""
    total = sum(spec.weight for spec in reward_fn.specs if spec.weight > 0)
    if total <= 0:
        raise ValueError("evaluation needs at least one reward with a positive weight to define 'correct'")
    return total


def score_generations(
    prompts: Sequence[PromptItem], generations: Sequence[Generation], reward_fn: CombinedReward
) -> list[dict[str, Any]]:
    """Per-sample records: id, answer, completion, reward, rewards, correct, num_tokens, latency_ms,
    finish_reason, error.

    `reward` is the weighted total and `rewards` the unweighted components. A sample is `correct` iff
    reward / (sum of positive weights) >= 0.5: with the default single `exact_match` that is an exact
    match; with several rewards, at least half of the attainable reward. Failed samples (error set) are
    not scored: completion and reward are None and correct is False; `summarize` leaves them out.
    """
    if len(prompts) != len(generations):
        raise ValueError(f"got {len(prompts)} prompts but {len(generations)} generations")
    best = positive_weight(reward_fn)
    ok = [i for i, g in enumerate(generations) if g.error is None]
    # The reward record is the data record with the answer the prompt carries (they may differ for
    # hand-built prompts), as in training.
    result = reward_fn.score(
        [generations[i].text or "" for i in ok],
        [{**prompts[i].record, "answer": prompts[i].answer} for i in ok],
    )
    scored = {i: j for j, i in enumerate(ok)}
    records = []
    for i, (prompt, gen) in enumerate(zip(prompts, generations, strict=True)):
        j = scored.get(i)
        reward = None if j is None else result.total[j]
        records.append(
            {
                "id": prompt.sample_id,
                "answer": prompt.answer,
                "completion": gen.text if j is not None else None,
                "reward": reward,
                "rewards": None if j is None else {k: v[j] for k, v in result.per_reward.items()},
                "correct": reward is not None and reward / best >= 0.5,
                "num_tokens": gen.num_tokens,
                "latency_ms": gen.latency_ms,
                "finish_reason": gen.finish_reason,
                "error": gen.error,
            }
        )
    return records


# --------------------------------------------------------------------------- local generation


def _from_completion(completion: Completion, latency_ms: float) -> Generation:
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
        return [_from_completion(out[0], per_sample_ms) for out in outputs]
    generations = []
    for prompt in batch:
        start = clock()
        try:
            out = engine.generate([prompt], spec)[0][0]
        except GENERATION_ERRORS as err:
            generations.append(
                Generation(None, 0, (clock() - start) * 1000.0, None, f"{type(err).__name__}: {err}")
            )
        else:
            generations.append(_from_completion(out, (clock() - start) * 1000.0))
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
    """Greedy-decode every prompt with `engine` in batches and score the answers (see `score_generations`).

    A prompt the engine cannot serve (it raises one of GENERATION_ERRORS) becomes a failed record with the
    error message; the others are still evaluated. `latency_ms` of a sample is its batch's wall time
    (measured with `clock`, in seconds) divided by the batch size.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    spec = SamplingSpec(n=1, greedy=True, max_tokens=max_tokens)
    generations: list[Generation] = []
    for start in range(0, len(prompts), batch_size):
        generations.extend(_generate_batch(engine, prompts[start : start + batch_size], spec, clock))
    return score_generations(prompts, generations, reward_fn)


# --------------------------------------------------------------------------- image ablation


def ablate(prompts: list[PromptItem], seed: int) -> list[PromptItem]:
    """Copies of `prompts` with the images permuted across samples; text, answer and record stay in place.

    Only samples with the same number of images swap (the prompt text has one placeholder per image). Within
    each such group the permutation is a random cycle through all of them (Sattolo's algorithm), so no
    sample keeps its own images; a group of one sample cannot be permuted and keeps its images (warned).
    """
    rng = random.Random(seed)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if p.images:
            groups.setdefault(len(p.images), []).append(i)
    out = list(prompts)
    for count, members in sorted(groups.items()):
        if len(members) < 2:
            logger.warning("ablate: the only sample with %d image(s) keeps its own images", count)
            continue
        source = list(members)
        for k in range(len(source) - 1, 0, -1):  # Sattolo: j < k makes the permutation a single cycle
            j = rng.randrange(k)
            source[k], source[j] = source[j], source[k]
        for target, src in zip(members, source, strict=True):
            out[target] = replace(prompts[target], images=list(prompts[src].images))
    return out


# --------------------------------------------------------------------------- local evaluation


def _resolve_adapter(adapter: str | Path) -> Path:
    """The adapter directory: `adapter` itself, or its `adapter/` subfolder (a run directory)."""
    path = Path(adapter)
    if not path.is_dir():
        raise InputError(
            f"adapter '{path}' is not a directory; pass the adapter folder of a run (RUN_DIR/adapter), "
            "or omit --adapter to evaluate the base model"
        )
    for candidate in (path, path / "adapter"):
        if all((candidate / name).is_file() for name in ADAPTER_FILES):
            _check_adapter_files(candidate)
            return candidate
    raise InputError(
        f"adapter '{path}' lacks {' and '.join(ADAPTER_FILES)}; pass a PEFT adapter folder "
        "(saved with safetensors), e.g. RUN_DIR/adapter"
    )


def _check_adapter_files(adapter_dir: Path) -> None:
    """Refuse a damaged adapter before any engine starts: checksums when it has a manifest (an export or a run's
    final adapter), and in any case weights that safetensors can open."""
    from safetensors import SafetensorError, safe_open

    from visionrl.export import MANIFEST_NAME, verify_adapter

    if (adapter_dir / MANIFEST_NAME).is_file():
        verify_adapter(str(adapter_dir))
    weights = adapter_dir / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), "pt") as f:
            f.keys()
    except SafetensorError as err:
        raise InputError(
            f"{weights} cannot be read ({err}): the file is damaged or incomplete; re-save or re-export the adapter"
        ) from None


def _read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    cfg_path = adapter_dir / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise InputError(f"{cfg_path} is not valid JSON ({err}); re-export the adapter") from None
    missing = [k for k in ("r", "lora_alpha", "target_modules") if cfg.get(k) is None]
    if missing or not isinstance(cfg["r"], int):
        raise InputError(
            f"{cfg_path} lacks {', '.join(missing) or 'an integer r'}; pass a PEFT LoRA adapter folder"
        )
    # Both engines rebuild the LoRA layout from r, lora_alpha and target_modules only.
    unsupported = [k for k in ("modules_to_save", "rank_pattern", "alpha_pattern") if cfg.get(k)]
    if unsupported:
        raise InputError(
            f"{cfg_path} sets {', '.join(unsupported)}, which local evaluation does not support; "
            "save the adapter with plain LoRA layers (one rank and alpha, no modules_to_save)"
        )
    return cfg


def _peft_targets(target_modules: str | list[str]) -> str:
    """One regex with peft's meaning of `target_modules`: a string is a full-match regex; a list of names
    matches a module whose name is, or ends in '.' + , one of them."""
    if isinstance(target_modules, str):
        return target_modules
    names = "|".join(re.escape(str(name)) for name in sorted(target_modules))
    return rf"(?:.*\.)?(?:{names})"


def _build_engine(
    engine: str,
    base: str,
    adapter_cfg: dict[str, Any] | None,
    forbidden: list[int],
    max_images: int,
    seed: int,
) -> Any:
    """The rollout engine for local evaluation, with a LoRA layout matching the adapter (if any)."""
    from visionrl.rollout.vllm_engine import cpu_only

    dtype = "float32" if cpu_only() else "bfloat16"  # bf16 is 4-20x slower than fp32 on CPUs (FACTS.md)
    if engine == "vllm":
        from visionrl.rollout.vllm_engine import VLLMEngine

        rank = adapter_cfg["r"] if adapter_cfg else 16  # no adapter: LoRA is enabled but never requested
        tower = adapter_cfg is not None and "visual" in json.dumps(adapter_cfg["target_modules"])
        return VLLMEngine(
            base,
            lora_rank=rank,
            tower_lora=tower,
            forbidden_token_ids=forbidden,
            dtype=dtype,
            seed=seed,
            max_images_per_prompt=max(1, max_images),
        )
    from visionrl.config import LoraConfig
    from visionrl.rollout.hf_engine import HFEngine

    # Without an adapter the default LoRA has B = 0, so the model equals the base model.
    lora = LoraConfig()
    if adapter_cfg:
        lora = LoraConfig(
            rank=adapter_cfg["r"],
            alpha=float(adapter_cfg["lora_alpha"]),
            target_modules=_peft_targets(adapter_cfg["target_modules"]),
        )
    return HFEngine(base, lora=lora, forbidden_token_ids=forbidden, dtype=dtype, seed=seed)


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
) -> dict[str, Any]:
    """Evaluate `base` (+ `adapter`) on `data` with a local engine ("vllm" or "hf"); write and return the report.

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
    if not os.path.isfile(data):
        raise InputError(f"data file '{data}' not found; pass a JSONL or Parquet file of evaluation records")
    check_model_dir(base)
    adapter_dir = _resolve_adapter(adapter) if adapter else None
    adapter_cfg = _read_adapter_config(adapter_dir) if adapter_dir else None
    reward_names = list(rewards or ["exact_match"])
    reward_fn = build_reward_fn([RewardSpec(name) for name in reward_names])

    processor = load_processor(base)
    prompts = [build_prompt(sample, processor) for sample in load_dataset(data, max_samples=max_samples)]
    if ablate_images:
        prompts = ablate(prompts, seed)
    forbidden = vision_token_ids(AutoConfig.from_pretrained(base), processor)
    max_images = max(len(p.images) for p in prompts)
    runner = _build_engine(engine, base, adapter_cfg, forbidden, max_images, seed)
    try:
        if adapter_dir is not None:
            files = {name: (adapter_dir / name).read_bytes() for name in ADAPTER_FILES}
            runner.load_adapter(AdapterPayload(version=1, files=files))
        started, t0 = time.time(), time.perf_counter()
        records = evaluate_prompts(runner, prompts, reward_fn, max_tokens=max_tokens)
        duration_s = time.perf_counter() - t0
    finally:
        runner.close()
        reward_fn.close()
    model = base if adapter_dir is None else f"{base} + {adapter_dir}"
    extra = {
        "base": base, "adapter": None if adapter_dir is None else str(adapter_dir), "engine": engine,
        "rewards": reward_names, "max_tokens": max_tokens, "seed": seed,
    }  # fmt: skip
    report = summarize(
        records,
        model=model,
        data=data,
        started=started,
        duration_s=duration_s,
        ablate_images=ablate_images,
        extra=extra,
    )
    write_report(report, out)
    return report


# --------------------------------------------------------------------------- served evaluation


def _forbidden_token_ids(base: str) -> list[int]:
    from transformers import AutoConfig

    from visionrl.models.loader import check_model_dir, load_processor, vision_token_ids

    check_model_dir(base)
    return vision_token_ids(AutoConfig.from_pretrained(base), load_processor(base))


def evaluate_endpoint(
    endpoint: str,
    model: str | None,
    data: str,
    out: str,
    concurrency: int = 8,
    ablate_images: bool = False,
    max_samples: int | None = None,
    max_tokens: int = 32,
    rewards: list[str] | None = None,
    timeout_s: float = 60.0,
    *,
    seed: int = 0,
    base: str | None = None,
    max_retries: int = 2,
) -> dict[str, Any]:
    """Evaluate the model or adapter `model` served at `endpoint` (OpenAI base URL) on `data`; write and
    return the report, in the format of `evaluate_local`.

    The chat messages are the data's, with every image sent as a base64 PNG; answers are greedy. A failed
    request counts in `num_failed` with its error (see `visionrl.endpoint_client.request_answers`). `base`
    (optional), the served base model's directory, forbids its vision tokens as local evaluation does.
    """
    from visionrl.data.dataset import load_dataset
    from visionrl.data.prompts import prompt_messages
    from visionrl.endpoint_client import chat_messages, request_answers

    if not model:
        raise InputError("served evaluation needs --model NAME: an adapter or base model name the endpoint "
                         "lists (GET /v1/models)")  # fmt: skip
    if concurrency < 1:
        raise InputError(f"concurrency must be >= 1, got {concurrency}")
    if not os.path.isfile(data):
        raise InputError(f"data file '{data}' not found; pass a JSONL or Parquet file of evaluation records")
    forbidden = _forbidden_token_ids(base) if base else []
    reward_names = list(rewards or ["exact_match"])
    reward_fn = build_reward_fn([RewardSpec(name) for name in reward_names])
    samples = list(load_dataset(data, max_samples=max_samples))
    # The server applies the chat template; the prompt text stays empty here.
    prompts = [PromptItem("", list(s.images), s.answer, dict(s.record), s.id) for s in samples]
    if ablate_images:
        prompts = ablate(prompts, seed)
    requests = [chat_messages(prompt_messages(s), p.images) for s, p in zip(samples, prompts, strict=True)]
    try:
        started, t0 = time.time(), time.perf_counter()
        generations = request_answers(
            endpoint,
            model,
            requests,
            max_tokens=max_tokens,
            concurrency=concurrency,
            timeout_s=timeout_s,
            max_retries=max_retries,
            forbidden_token_ids=forbidden,
        )
        records = score_generations(prompts, generations, reward_fn)
        duration_s = time.perf_counter() - t0
    finally:
        reward_fn.close()
    extra = {
        "endpoint": endpoint, "served_model": model, "base": base, "engine": "endpoint", "rewards": reward_names,
        "max_tokens": max_tokens, "seed": seed, "concurrency": concurrency, "timeout_s": timeout_s,
    }  # fmt: skip
    report = summarize(records, model=f"{model} @ {endpoint}", data=data, started=started, duration_s=duration_s,
                       ablate_images=ablate_images, extra=extra)  # fmt: skip
    write_report(report, out)
    return report
