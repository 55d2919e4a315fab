"""Rewards for GRPO: built-in scorers, user functions by import path, and their isolated weighted sum.

A reward is ``f(completion: str, answer, record: dict) -> float``. Build the job's rewards with
``build_reward_fn([RewardSpec("exact_match", weight=1.0), RewardSpec("format", weight=0.5)])`` and
score a batch with ``.score(completions, records)``.
"""

from visionrl.rewards.builtin import choice, exact_match, format_reward, iou, list_builtin_rewards, numeric
from visionrl.rewards.combined import CombinedReward, RewardResult, build_reward_fn, component_keys
from visionrl.rewards.isolation import Outcome, RewardWorkerError
from visionrl.rewards.registry import RewardConfigError, RewardFn, RewardSpec, resolve_reward

__all__ = [
    "CombinedReward",
    "Outcome",
    "RewardConfigError",
    "RewardFn",
    "RewardResult",
    "RewardSpec",
    "RewardWorkerError",
    "build_reward_fn",
    "choice",
    "component_keys",
    "exact_match",
    "format_reward",
    "iou",
    "list_builtin_rewards",
    "numeric",
    "resolve_reward",
]
