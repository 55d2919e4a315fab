"""What a step writes besides its checkpoint: its metrics, assembled from rollouts, rewards, the learner's stats
and the phases' wall times (`StepClock`); its line in the run's history; its TensorBoard scalars and histograms; and the rollouts shown as pictures
(the first completion of the first groups, with question, answer and reward; `visionrl.pictures` draws them).
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from visionrl import history as history_file
from visionrl import metrics as tags
from visionrl.algo import group_stats
from visionrl.config import JobConfig
from visionrl.data.prompts import question_text
from visionrl.errors import StorageError
from visionrl.orchestrate.failures import resume_hint
from visionrl.pictures import RolloutSample, strip
from visionrl.rewards import RewardResult
from visionrl.run_layout import RunDir
from visionrl.trackers import RunTrackers
from visionrl.types import Completion, PromptItem


class StepClock:
    """Wall time of each phase of a step, as `timing/<phase>_s`, plus the whole step."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._times: dict[str, float] = {}
        self._phase = ""

    def start(self) -> None:
        self._t0, self._times = time.perf_counter(), {}

    def __call__(self, phase: str) -> StepClock:
        self._phase = phase
        return self

    def __enter__(self) -> None:  # a phase may run several times in a step: times add up
        self._times[self._phase] = self._times.get(self._phase, 0.0) - time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._times[self._phase] += time.perf_counter()

    def metrics(self) -> dict[str, float]:
        out = {tags.timing_tag(k): v for k, v in self._times.items()}
        out[tags.TIMING_STEP] = time.perf_counter() - self._t0
        return out


def step_metrics(
    rewards: torch.Tensor,
    completions: list[list[Completion]],
    scores: RewardResult,
    stats: dict[str, float],
    G: int,
    n_kept: int,
) -> dict[str, float]:
    """The step's metrics of its rollouts (rewards, lengths, groups with signal, reward failures) and of the
    learner's `stats` (its tags; zeros where no update ran); `n_kept` groups went into the update."""
    flat = [c for group in completions for c in group]
    lengths = torch.tensor([sampled_tokens(c) for c in flat], dtype=torch.float32)
    gs = group_stats(rewards, G)
    m: dict[str, float] = {
        tags.REWARD_MEAN: float(rewards.mean()),
        tags.REWARD_STD: float(rewards.std(unbiased=False)),
        tags.ZERO_STD_FRACTION: float(gs["zero_std_fraction"]),
        tags.GROUPS_WITH_SIGNAL: 1.0 - float(gs["zero_std_fraction"]),
        tags.REWARD_ERRORS: float(sum(scores.num_errors.values())),
        tags.REWARD_TIMEOUTS: float(sum(scores.num_timeouts.values())),
        tags.LENGTH_MEAN: float(lengths.mean()),
        tags.LENGTH_MAX: float(lengths.max()),
        tags.TRUNCATED_FRACTION: sum(c.truncated for c in flat) / len(flat),
        tags.RESPONSE_TOKENS: float(lengths.sum()),
        tags.GROUPS_KEPT: float(n_kept),
        tags.ADAPTER_VERSION: float(flat[0].adapter_version),
    }
    for name, values in scores.per_reward.items():
        m[tags.reward_component_tag(name)] = sum(values) / len(values)
    if scores.seconds:  # a judge scored this step
        judged = [x for key in scores.seconds for x in scores.per_reward[key]]
        m[tags.JUDGE_MEAN] = sum(judged) / len(judged)
        m[tags.JUDGE_ERRORS] = float(sum(scores.num_errors[key] for key in scores.seconds))
        m[tags.JUDGE_TIMEOUTS] = float(sum(scores.num_timeouts[key] for key in scores.seconds))
        m[tags.TIMING_JUDGE] = sum(scores.seconds.values())
    for k, v in stats.items():
        if "/" in k:  # the learner's tags (metrics.py); plain keys are its internal counters
            m[k] = float(v)
    m.setdefault(tags.LOSS_POLICY, 0.0)
    m.setdefault(tags.LOSS_KL, 0.0)  # a required tag (0 without a KL term)
    m.setdefault(tags.SKIPPED_UPDATES, 0.0)
    return m


def sampled_tokens(c: Completion) -> int:
    """The tokens the model sampled (an episode's turns; not the environment's tokens between them)."""
    return len(c.token_ids) - (sum(c.env_mask) if c.env_mask is not None else 0)


def write_step(
    tb: RunTrackers,
    run: RunDir,
    step: int,
    m: dict[str, Any],
    prompts: list[PromptItem],
    completions: list[list[Completion]],
    scores: RewardResult,
    rewards: torch.Tensor,
    cfg: JobConfig,
) -> None:
    """The step's line in the run's history (every step: a killed run keeps its history), and, when due, its
    scalars and histograms in TensorBoard (logging.log_every) and its rollout pictures (logging.images_every,
    and step 1). A full disk: StorageError saying which checkpoint to continue from."""
    m[tags.THROUGHPUT] = m[tags.RESPONSE_TOKENS] / max(m[tags.TIMING_STEP], 1e-9)
    history_file.append(run.history, {"step": step, **m})  # every step: a killed run keeps its history
    try:
        if step % cfg.logging.log_every == 0:
            tb.scalars(step, m)
            tb.histogram(step, tags.REWARD_HIST, rewards)
            tb.histogram(step, tags.LENGTH_HIST, [sampled_tokens(c) for g in completions for c in g])
            if scores.seconds:
                tb.histogram(
                    step, tags.JUDGE_HIST, [x for key in scores.seconds for x in scores.per_reward[key]]
                )
        if step % cfg.logging.images_every == 0 or step == 1:
            samples = rollout_samples(
                prompts,
                completions,
                scores.total,
                cfg.logging.num_images,
                cfg.data.prompt_key,
                scores.verdicts,
            )
            tb.rollout_images(step, samples)
            tb.rollout_table(step, samples)
        tb.flush()
    except StorageError as err:  # TensorBoard's disk is full: this step is not checkpointed, say what is
        raise StorageError(f"{err}\n{resume_hint(run.root)}") from None


def rollout_samples(
    prompts: list[PromptItem],
    completions: list[list[Completion]],
    totals: list[float],
    n: int,
    prompt_key: str = "prompt",
    verdicts: dict[str, list[str]] | None = None,
) -> list[RolloutSample]:
    """A few rollouts (the first completion of the first `n` groups) for the TensorBoard picture grid; the question
    is the record's `prompt_key` field (data.prompt_key) or its messages' text."""
    out = []
    G = len(completions[0]) if completions else 1
    for i, (p, group) in enumerate(zip(prompts[:n], completions[:n], strict=False)):
        if not p.images:
            continue
        question = question_text(p.record, prompt_key)
        first = group[0]
        episode = first.episode or {}
        out.append(
            RolloutSample(
                # an episode: its pictures side by side (the prompt's, then each observation's) and its turns
                image=strip([p.images[0], *first.images]) if first.images else p.images[0],
                question=question,
                completion=str(episode.get("transcript", first.text)),
                answer=json.dumps(p.answer) if not isinstance(p.answer, str) else p.answer,
                reward=float(totals[i * G]),
                verdict=" / ".join(v[i * G] for v in (verdicts or {}).values()),
            )
        )
    return out
