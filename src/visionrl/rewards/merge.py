"""Merging reward results: one `RewardResult` of several consecutive parts (the reward workers' shares of a
batch, or a step's dynamic-sampling rounds), in order."""

from __future__ import annotations

from visionrl.rewards.combined import RewardResult


def merge_results(parts: list[RewardResult]) -> RewardResult:
    """Totals, per-reward scores and judges' verdicts concatenated, error and timeout counts and judging seconds
    summed, the first failure message of each reward kept (the earliest part that has one)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return RewardResult(
        total=[x for p in parts for x in p.total],
        per_reward={k: [x for p in parts for x in p.per_reward[k]] for k in first.per_reward},
        num_errors={k: sum(p.num_errors[k] for p in parts) for k in first.num_errors},
        num_timeouts={k: sum(p.num_timeouts[k] for p in parts) for k in first.num_timeouts},
        error_examples={k: v for p in reversed(parts) for k, v in p.error_examples.items()},
        seconds={k: sum(p.seconds.get(k, 0.0) for p in parts) for k in first.seconds},
        verdicts={
            k: [x for p in parts for x in p.verdicts.get(k, [""] * len(p.total))] for k in first.verdicts
        },
    )
