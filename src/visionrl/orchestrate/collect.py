"""Phases 1-3 of a step, collecting its batch: sample prompts, roll out `group_size` completions of each on the
engines, score them on the reward workers. With dynamic sampling (DAPO) further batches until the step has
enough groups with signal; prompts the engines reject are left out and counted. `collect_ahead` is the same
run in the background during the update before (rollout.async_steps, `orchestrate.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from visionrl import metrics as tags
from visionrl.algo import groups_with_signal
from visionrl.config import JobConfig
from visionrl.errors import RunError
from visionrl.orchestrate.prompt_stream import PromptStream
from visionrl.orchestrate.step_log import StepClock
from visionrl.orchestrate.workers import Workers
from visionrl.rewards import RewardResult
from visionrl.rewards.merge import merge_results
from visionrl.types import Completion, PromptItem, SamplingSpec


@dataclass
class Collected:
    """The rollouts of one step: groups in order, their scores, and which groups the update uses."""

    prompts: list[PromptItem]
    completions: list[list[Completion]]
    scores: RewardResult
    rewards: torch.Tensor  # [num_groups * group_size]
    keep: torch.Tensor  # [num_groups] bool
    rounds: int
    skipped: int = 0  # prompts the engines rejected (left out of the step, never failing it)
    # rollout and reward times when collected ahead (async), else in the step's own clock
    timing: dict[str, float] = field(default_factory=dict)


MAX_REJECTED_BATCHES = 3  # batches in a row whose every prompt the engines rejected before the run stops


def collect(
    prompts_in: PromptStream, workers: Workers, spec: SamplingSpec, cfg: JobConfig, clock: StepClock
) -> Collected:
    """Phases 1-3 of a step. Without dynamic sampling: one batch of prompts, every group kept. With it (DAPO):
    only groups whose rewards differ are kept, and further batches are sampled (at most max_sampling_rounds)
    until prompts_per_step such groups are found; surplus groups are dropped. Metrics cover every sampled group.
    Prompts an engine rejects (no completions) are left out and counted; a batch that loses every prompt
    is replaced by the next one, up to MAX_REJECTED_BATCHES in a row."""
    G, want = cfg.algorithm.group_size, cfg.rollout.prompts_per_step
    rounds_max = cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1
    prompts: list[PromptItem] = []
    completions: list[list[Completion]] = []
    parts: list[RewardResult] = []
    keep: list[bool] = []
    skipped = empty = r = 0
    while r < rounds_max:
        batch = prompts_in.next_batch()  # 1. sample prompts
        with clock("rollout"):  # 2. rollout with the current adapter
            groups = workers.rollout(batch, replace(spec, seed=None if spec.seed is None else spec.seed + r))
        batch, groups, rejected = _without_rejected(batch, groups)
        skipped += rejected
        if not batch:
            empty += 1
            if empty >= MAX_REJECTED_BATCHES:
                raise RunError(
                    f"the engines rejected every prompt of {empty} batches in a row (see the warnings above for "
                    "why); check rollout.max_model_len and data.max_pixels against your data"
                )
            continue
        empty, r = 0, r + 1
        with clock("reward"):  # 3. reward
            scores = workers.score(batch, groups)
        rewards = torch.tensor(scores.total, dtype=torch.float32)
        signal = (
            groups_with_signal(rewards, G)
            if cfg.algorithm.dynamic_sampling
            else torch.ones(len(batch), dtype=torch.bool)
        )
        for ok in signal.tolist():
            keep.append(ok and sum(keep) < want)
        prompts += batch
        completions += groups
        parts.append(scores)
        if sum(keep) >= want:
            break
    scores = merge_results(parts)
    return Collected(
        prompts,
        completions,
        scores,
        torch.tensor(scores.total, dtype=torch.float32),
        torch.tensor(keep, dtype=torch.bool),
        r,
        skipped,
    )


def collect_ahead(
    prompts_in: PromptStream, workers: Workers, spec: SamplingSpec, cfg: JobConfig
) -> Collected:
    """`collect` run ahead (rollout.async_steps), timed by its own clock: the step's clock is not running yet."""
    clock = StepClock()
    got = collect(prompts_in, workers, spec, cfg, clock)
    got.timing = {k: v for k, v in clock.metrics().items() if k != tags.TIMING_STEP}
    return got


def _without_rejected(
    batch: list[PromptItem], groups: list[list[Completion]]
) -> tuple[list[PromptItem], list[list[Completion]], int]:
    """The prompts that got completions, their groups, and how many prompts the engines rejected."""
    kept = [i for i, group in enumerate(groups) if group]
    return [batch[i] for i in kept], [groups[i] for i in kept], len(batch) - len(kept)
