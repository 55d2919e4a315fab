"""Group-relative advantages for GRPO-style training: pure tensor math, no I/O.

Each prompt is sampled ``group_size`` times, and a completion's advantage is its reward relative to the
other completions of the same prompt, so no value network is needed. Rewards arrive flat and grouped
contiguously: ``rewards[i * group_size:(i + 1) * group_size]`` belong to prompt ``i``.

Variants of the normalisation are looked up by name in ``_SCALES``:

- ``"std"`` (GRPO): ``(r - group mean) / (group sample std + eps)``, sample std with the n-1 correction.
- ``"none"`` (Dr. GRPO): ``r - group mean``; dividing by the std over-weights groups that are almost
  all-correct or all-wrong, which Dr. GRPO identifies as a bias.

A group whose rewards are all equal carries no learning signal and gets advantage exactly 0. With
``group_size == 1`` every group is such a group (there is no baseline to compare against), so every
advantage is 0: that is a valid but useless configuration, not an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["ADVANTAGE_SCALES", "group_advantages", "group_stats", "groups_with_signal"]

# (centred rewards [G, n], raw grouped rewards [G, n], eps) -> scaled advantages [G, n]
ScaleFn = Callable[[Tensor, Tensor, float], Tensor]


def _std_scale(centered: Tensor, grouped: Tensor, eps: float) -> Tensor:
    """Divide by the unbiased per-group std plus ``eps`` (GRPO)."""
    if grouped.shape[1] < 2 or grouped.shape[0] == 0:
        # The sample std of one value is undefined (0/0); its centred reward is already 0.
        return centered
    std = grouped.std(dim=1, correction=1, keepdim=True)
    return centered / (std + eps)


def _no_scale(centered: Tensor, grouped: Tensor, eps: float) -> Tensor:
    """Keep the centred rewards as they are (Dr. GRPO)."""
    return centered


_SCALES: dict[str, ScaleFn] = {"std": _std_scale, "none": _no_scale}

#: Names accepted by ``group_advantages(scale=...)``; configs can validate against this.
ADVANTAGE_SCALES: tuple[str, ...] = tuple(_SCALES)


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate flat rewards and view them as a floating ``[num_groups, group_size]`` tensor."""
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1 (completions per prompt), got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}; "
            "flatten the per-completion rewards in prompt order"
        )
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} elements, not a multiple of group_size={group_size}: every "
            "prompt must contribute exactly group_size contiguous completions; drop incomplete groups "
            "or fix group_size"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards).all()):
        bad = int((~torch.isfinite(rewards)).sum())
        raise ValueError(
            f"rewards contain {bad} non-finite value(s) (NaN/inf); score failed completions with a finite "
            "value (e.g. 0) and count them instead"
        )
    return rewards.reshape(-1, group_size)


def _all_equal(grouped: Tensor) -> Tensor:
    """BoolTensor [num_groups]: True where every reward of the group equals its first one."""
    return (grouped == grouped[:, :1]).all(dim=1)


def group_advantages(rewards: Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per completion.

    Args:
        rewards: [num_prompts * group_size], each prompt's completions contiguous.
        group_size: completions per prompt (>= 1; 1 gives all-zero advantages).
        scale: a name from ``ADVANTAGE_SCALES``: ``"std"`` (GRPO) or ``"none"`` (Dr. GRPO).
        eps: added to the group std before dividing (``scale="std"`` only), >= 0.

    Returns:
        Advantages with the shape of ``rewards``, floating (integer/bool rewards become the default
        float dtype). Groups with all-equal rewards get exactly 0.
    """
    try:
        scale_fn = _SCALES[scale]
    except KeyError:
        raise ValueError(f"unknown advantage scale {scale!r}; choose one of {list(_SCALES)}") from None
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    grouped = _grouped(rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    advantages = scale_fn(centered, grouped, eps)
    # Force exact zeros: the float mean of equal values need not round back to that value, and the tiny
    # residue divided by (std ~ 1e-17) + eps would be a spurious nonzero advantage.
    advantages = torch.where(_all_equal(grouped)[:, None], torch.zeros_like(advantages), advantages)
    return advantages.reshape(-1)


def groups_with_signal(rewards: Tensor, group_size: int) -> Tensor:
    """BoolTensor [num_groups]: True where the group's rewards are not all equal.

    Groups that are False give zero advantage and hence zero policy gradient; DAPO's dynamic sampling
    drops them and samples more prompts instead.
    """
    return ~_all_equal(_grouped(rewards, group_size))


def group_stats(rewards: Tensor, group_size: int) -> dict[str, Tensor]:
    """Summary statistics of a batch of grouped rewards, as detached 0-d float tensors.

    Keys:
        ``num_groups``: number of prompts.
        ``zero_std_fraction``: share of groups whose rewards are all equal (no learning signal).
        ``group_std_mean``: mean over groups of the unbiased within-group std (0 when group_size is 1).
        ``reward_mean``, ``reward_std``: over all completions (unbiased std; 0 for fewer than 2).

    An empty batch gives all zeros rather than NaN.
    """
    grouped = _grouped(rewards, group_size).detach()
    flat = grouped.reshape(-1)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    num_groups = grouped.shape[0]
    if num_groups == 0:
        return {
            k: zero
            for k in ("num_groups", "zero_std_fraction", "group_std_mean", "reward_mean", "reward_std")
        }
    group_std = grouped.std(dim=1, correction=1) if group_size > 1 else torch.zeros_like(grouped[:, 0])
    return {
        "num_groups": torch.tensor(float(num_groups), dtype=grouped.dtype, device=grouped.device),
        "zero_std_fraction": _all_equal(grouped).to(grouped.dtype).mean(),
        "group_std_mean": group_std.mean(),
        "reward_mean": flat.mean(),
        "reward_std": flat.std(correction=1) if flat.numel() > 1 else zero,
    }
