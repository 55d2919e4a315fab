"""Tests of visionrl.algo.advantages: group-relative advantages, signal filtering and group statistics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from visionrl.algo import ADVANTAGE_SCALES, group_advantages, group_stats, groups_with_signal


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_grpo_std_scale_hand_numbers() -> None:
    # Group 1 = [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum of squares 4 * 0.25 = 1,
    # unbiased variance 1 / (4 - 1) = 1/3, std sqrt(1/3) = 0.5773503.
    # Advantage = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239 (eps shaves 1.5e-6 off sqrt(3)/2 = 0.8660254).
    # Group 2 = [1, 1, 1, 1]: all equal -> exactly 0.
    adv = group_advantages(_t([1, 0, 0, 1, 1, 1, 1, 1]), 4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert a == pytest.approx(0.8660239, abs=1e-7)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0, 0, 0, 0], abs=1e-12)
    assert adv[4:].eq(0).all()


def test_grpo_eps_zero_gives_exact_sqrt3_over_2() -> None:
    # Same group as above without eps: 0.5 / sqrt(1/3) = sqrt(3)/2.
    adv = group_advantages(_t([1, 0, 0, 1]), 4, eps=0.0)
    h = math.sqrt(3) / 2
    assert adv.tolist() == pytest.approx([h, -h, -h, h], abs=1e-12)


def test_std_scale_second_hand_example() -> None:
    # [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25];
    # squares 0.5625 + 3 * 0.0625 = 0.75, unbiased variance 0.75 / 3 = 0.25, std 0.5.
    # eps = 0 -> [1.5, -0.5, -0.5, -0.5].
    adv = group_advantages(_t([1, 0, 0, 0]), 4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-12)


def test_dr_grpo_no_scale() -> None:
    # scale="none": only the group mean is removed.
    # [1, 0, 0, 0] - 0.25 = [0.75, -0.25, -0.25, -0.25]; [0.5] * 4 is all equal -> 0.
    adv = group_advantages(_t([1, 0, 0, 0, 0.5, 0.5, 0.5, 0.5]), 4, scale="none")
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], abs=1e-12)


@pytest.mark.parametrize("scale", ADVANTAGE_SCALES)
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_all_equal_group_is_exactly_zero(scale: str, eps: float) -> None:
    # Three float32 0.1s: the float mean need not equal 0.1 exactly; the result must still be exactly 0,
    # and with eps = 0 there must be no 0/0 NaN.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], dtype=torch.float32)
    adv = group_advantages(rewards, 3, scale=scale, eps=eps)
    assert torch.equal(adv, torch.zeros(6))


@pytest.mark.parametrize("scale", ADVANTAGE_SCALES)
def test_group_size_one_gives_zeros(scale: str) -> None:
    # No other completion to compare against -> no baseline information -> zero advantage, no NaN.
    adv = group_advantages(_t([3.0, -1.0, 0.5]), 1, scale=scale)
    assert torch.equal(adv, torch.zeros(3, dtype=torch.float64))


def test_integer_and_bool_rewards_become_float() -> None:
    # [1, 0] as ints: mean 0.5, unbiased std sqrt(0.5) = 0.7071068 -> +-0.5 / 0.7071068 = +-0.7071068.
    adv = group_advantages(torch.tensor([1, 0]), 2, eps=0.0)
    assert adv.dtype == torch.get_default_dtype()
    assert adv.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-6)
    adv_bool = group_advantages(torch.tensor([True, False]), 2, scale="none")
    assert adv_bool.tolist() == pytest.approx([0.5, -0.5])


def test_empty_rewards() -> None:
    assert group_advantages(_t([]), 4).shape == (0,)
    assert groups_with_signal(_t([]), 4).shape == (0,)


def test_groups_with_signal() -> None:
    # Groups of 2: [1, 0] signal, [1, 1] none, [0, 0] none, [0, 1] signal.
    mask = groups_with_signal(_t([1, 0, 1, 1, 0, 0, 0, 1]), 2)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [True, False, False, True]
    # group_size 1 never has signal, consistent with its all-zero advantages.
    assert groups_with_signal(_t([1, 0]), 1).tolist() == [False, False]


def test_group_stats_hand_numbers() -> None:
    # [1, 0, 0, 1 | 1, 1, 1, 1]:
    # zero_std_fraction = 1 of 2 groups = 0.5;
    # group_std_mean = (sqrt(1/3) + 0) / 2 = 0.2886751;
    # reward_mean = 6 / 8 = 0.75;
    # reward_std: six 1s deviate 0.25 (6 * 0.0625 = 0.375), two 0s deviate 0.75 (2 * 0.5625 = 1.125),
    # sum 1.5, / (8 - 1) = 0.2142857, sqrt = 0.4629100.
    stats = group_stats(_t([1, 0, 0, 1, 1, 1, 1, 1]), 4)
    assert float(stats["num_groups"]) == 2
    assert float(stats["zero_std_fraction"]) == pytest.approx(0.5)
    assert float(stats["group_std_mean"]) == pytest.approx(math.sqrt(1 / 3) / 2, abs=1e-12)
    assert float(stats["reward_mean"]) == pytest.approx(0.75)
    assert float(stats["reward_std"]) == pytest.approx(math.sqrt(1.5 / 7), abs=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_group_stats_edge_cases() -> None:
    empty = group_stats(_t([]), 4)
    assert all(float(v) == 0 for v in empty.values())
    # group_size 1: every group trivially all-equal, within-group std defined as 0.
    single = group_stats(_t([1, 0, 1]), 1)
    assert float(single["zero_std_fraction"]) == 1.0
    assert float(single["group_std_mean"]) == 0.0
    # One completion overall: no NaN from a one-sample std.
    assert float(group_stats(_t([2.0]), 1)["reward_std"]) == 0.0


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (torch.zeros(2, 4), 4, "1-D"),
        (torch.zeros(6), 4, "not a multiple of group_size=4"),
        (torch.zeros(4), 0, "group_size must be an int >= 1"),
        (torch.zeros(4), 2.0, "group_size must be an int >= 1"),
        (torch.tensor([1.0, float("nan")]), 2, "non-finite"),
    ],
)
def test_bad_inputs_raise(rewards: torch.Tensor, group_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, group_size)
    with pytest.raises(ValueError, match=match):
        groups_with_signal(rewards, group_size)


def test_bad_options_raise() -> None:
    with pytest.raises(ValueError, match=r"unknown advantage scale 'rank'.*'std', 'none'"):
        group_advantages(torch.zeros(4), 2, scale="rank")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        group_advantages(torch.zeros(4), 2, eps=-1.0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        group_advantages([1.0, 0.0], 2)  # type: ignore[arg-type]


# Reward-like values (multiples of 0.5 in [-3, 3]) keep float error far below the tolerances.
_rewards_and_group = st.integers(1, 6).flatmap(
    lambda g: st.tuples(
        st.lists(st.integers(-6, 6), min_size=g, max_size=5 * g).map(lambda xs: xs[: len(xs) - len(xs) % g]),
        st.just(g),
    )
)


@settings(max_examples=60, deadline=None)
@given(data=_rewards_and_group, scale=st.sampled_from(ADVANTAGE_SCALES))
def test_property_zero_group_mean(data: tuple[list[int], int], scale: str) -> None:
    values, g = data
    adv = group_advantages(_t([v / 2 for v in values]), g, scale=scale)
    assert adv.reshape(-1, g).mean(dim=1).abs().max() < 1e-9


@settings(max_examples=60, deadline=None)
@given(data=_rewards_and_group, shift=st.integers(-5, 5), factor=st.integers(1, 4))
def test_property_std_scale_is_shift_and_scale_invariant(
    data: tuple[list[int], int], shift: int, factor: int
) -> None:
    # With eps = 0, (r - mean) / std is unchanged by r -> factor * r + shift, and a group with signal has
    # unit sample std after scaling.
    values, g = data
    base = group_advantages(_t([v / 2 for v in values]), g, eps=0.0)
    moved = group_advantages(_t([factor * v / 2 + shift for v in values]), g, eps=0.0)
    assert torch.allclose(base, moved, atol=1e-9)
    if g > 1 and len(values) > 0:
        signal = groups_with_signal(_t([float(v) for v in values]), g)
        stds = base.reshape(-1, g).std(dim=1)
        assert torch.allclose(stds[signal], torch.ones_like(stds[signal]), atol=1e-9)
        assert stds[~signal].eq(0).all()


def test_a_std_floor_keeps_a_judges_noise_small() -> None:
    """Four wrong answers a judge scores 0.01, 0, 0, 0: mean 0.0025, sample std 0.005. Divided by the std alone the
    noise becomes a full-size advantage (1.5); with algorithm.advantage_std_eps 0.1 it stays 0.0075 / 0.105."""
    rewards = torch.tensor([0.01, 0.0, 0.0, 0.0])
    assert float(group_advantages(rewards, 4)[0]) == pytest.approx(1.5, rel=1e-3)
    assert float(group_advantages(rewards, 4, eps=0.1)[0]) == pytest.approx(0.0075 / 0.105, rel=1e-5)
