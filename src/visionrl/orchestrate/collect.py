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
from visionrl.envs.episodes import EpisodeBatch
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
    # multi-turn episodes: each episode's own prompt for the learner ([group][member]), the episode metrics
    train_prompts: list[list[PromptItem]] | None = None
    episode_metrics: dict[str, float] = field(default_factory=dict)


ENV_COMPONENT = "env"  # the environment's step rewards as a reward component (multi-turn episodes)
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
    episodes: list[EpisodeBatch] = []
    skipped = empty = r = 0
    while r < rounds_max:
        batch = prompts_in.next_batch()  # 1. sample prompts
        round_spec = replace(spec, seed=None if spec.seed is None else spec.seed + r)
        with clock("rollout"):  # 2. rollout with the current adapter (multi-turn: whole episodes)
            if workers.episodes is not None:
                episodes.append(workers.episodes.run(batch, workers.episode_lanes(), round_spec))
                batch, groups = episodes[-1].prompts, episodes[-1].completions
            else:
                groups = workers.rollout(batch, round_spec)
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
        with clock("reward"):  # 3. reward (multi-turn: the final turn's, plus the environment's)
            scores = workers.score(batch, groups) if cfg.rewards else _no_rewards(len(batch) * G)
            if episodes:
                scores = with_env_returns(scores, episodes[-1])
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
        train_prompts=[p for e in episodes for p in e.train_prompts] if episodes else None,
        episode_metrics=merge_episode_metrics([e.metrics for e in episodes]),
    )


def _no_rewards(n: int) -> RewardResult:
    """The job's rewards when it lists none (an environment's rewards only)."""
    return RewardResult(total=[0.0] * n, per_reward={})


def with_env_returns(scores: RewardResult, episodes: EpisodeBatch) -> RewardResult:
    """The job's rewards on each episode's final turn plus its environment's step rewards (`env` component); an
    episode whose environment failed scores 0."""
    env = [c.episode["env_reward"] if c.episode else 0.0 for group in episodes.completions for c in group]
    failed = [f for group in episodes.failed for f in group]
    total = [0.0 if bad else t + e for t, e, bad in zip(scores.total, env, failed, strict=True)]
    return replace(scores, total=total, per_reward={**scores.per_reward, ENV_COMPONENT: env})


def merge_episode_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The episode metrics of a step's sampling rounds as one: means averaged, counts and seconds summed."""
    if len(parts) <= 1:
        return parts[0] if parts else {}
    out: dict[str, float] = {}
    for key in {k for p in parts for k in p}:
        values = [p.get(key, 0.0) for p in parts]
        averaged = key.endswith(("_mean", "_fraction"))
        out[key] = sum(values) / len(values) if averaged else sum(values)
    return out


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
