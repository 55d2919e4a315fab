"""Tests of PPO's clipped policy loss (visionrl.algo.policy_losses), the aggregations (visionrl.algo.aggregation),
and the KL estimators, entropy and token log-probs (visionrl.algo.losses)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from visionrl.algo import (
    AGGREGATIONS,
    KL_KINDS,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
)

F64 = torch.float64
NAN = float("nan")


def _t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ----------------------------------------------------------------------------------------------------
# masked_mean / aggregate
# ----------------------------------------------------------------------------------------------------

# 3 x 3: row 0 has 3 tokens, row 1 has 2 (its last is masked and holds NaN), row 2 is fully masked
# (holding large garbage). Only the five values 1..5 may matter.
VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, NAN], [100.0, 100.0, 100.0]]
MASK = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
# token_mean:              (1 + 2 + 3 + 4 + 5) / 5                = 3
# seq_mean_token_mean:     row means 2 and 4.5, over 2 sequences   = 3.25
# seq_mean_token_sum:      row sums 6 and 9, over 2 sequences      = 7.5
# seq_mean_token_sum_norm: (6 / 3 + 9 / 3) / 2 with T = 3          = 2.5
EXPECTED = {
    "token_mean": 3.0,
    "seq_mean_token_mean": 3.25,
    "seq_mean_token_sum": 7.5,
    "seq_mean_token_sum_norm": 2.5,
}


def test_aggregations_known_set() -> None:
    assert set(AGGREGATIONS) == set(EXPECTED)


@pytest.mark.parametrize("aggregation", list(EXPECTED))
def test_aggregate_hand_numbers(aggregation: str) -> None:
    out = aggregate(_t(VALUES), torch.tensor(MASK), aggregation)
    assert float(out) == pytest.approx(EXPECTED[aggregation], abs=1e-12)


def test_aggregate_normalisers() -> None:
    values, mask = _t(VALUES), torch.tensor(MASK)
    # Global token count 10 instead of 5: 15 / 10.
    assert float(aggregate(values, mask, "token_mean", num_tokens=10)) == pytest.approx(1.5)
    # Global sequence count 4 instead of 2: (6 + 9) / 4.
    assert float(aggregate(values, mask, "seq_mean_token_sum", num_sequences=4)) == pytest.approx(3.75)
    # Dr. GRPO divisor 5 instead of T = 3: (6 / 5 + 9 / 5) / 2.
    assert float(aggregate(values, mask, "seq_mean_token_sum_norm", norm_length=5)) == pytest.approx(1.5)
    # Each aggregation ignores the normalisers of the others: num_sequences does not touch token_mean.
    assert float(aggregate(values, mask, "token_mean", num_sequences=99)) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        aggregate(values, mask, "token_mean", num_tokens=-1)


@pytest.mark.parametrize("aggregation", list(EXPECTED))
def test_aggregate_all_masked_is_zero_not_nan(aggregation: str) -> None:
    values = torch.full((2, 3), 5.0, dtype=F64, requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3), aggregation)
    out.backward()
    assert float(out.detach()) == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 3, dtype=F64))
    # A global normaliser of 0 (nothing to learn in the whole batch) also gives 0, not NaN.
    zero = aggregate(values.detach(), torch.zeros(2, 3), aggregation, num_tokens=0, num_sequences=0)
    assert float(zero) == 0.0


def test_aggregate_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"unknown aggregation 'sum'.*'token_mean'"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match=r"must both be \[B, T\]"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4), "token_mean")


def test_masked_mean() -> None:
    x, mask = _t(VALUES), torch.tensor(MASK)
    # All dims: 15 / 5 = 3. Per row: 6/3 = 2, 9/2 = 4.5, empty row -> 0. Per column: (1+4)/2, (2+5)/2, 3/1.
    assert float(masked_mean(x, mask)) == pytest.approx(3.0)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 4.5, 0.0])
    assert masked_mean(x, mask, dim=0).tolist() == pytest.approx([2.5, 3.5, 3.0])
    assert float(masked_mean(x, torch.zeros(3, 3))) == 0.0
    with pytest.raises(ValueError, match="mask shape"):
        masked_mean(x, torch.ones(3))


# ----------------------------------------------------------------------------------------------------
# policy_loss
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", list(EXPECTED))
def test_policy_loss_aggregations_at_ratio_one(aggregation: str) -> None:
    # With logprobs == old_logprobs the ratio is 1, nothing clips, and the per-token loss is -A.
    # Per-token advantages A = -VALUES therefore reproduce the hand-computed aggregates above.
    # The NaN log-prob at a masked position must not leak into the loss or the gradient.
    logprobs = _t([[-1.0, -1.0, -1.0], [-1.0, -1.0, NAN], [NAN, NAN, NAN]]).requires_grad_()
    old = _t([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    adv = -torch.nan_to_num(_t(VALUES))
    loss, metrics = policy_loss(logprobs, old, adv, torch.tensor(MASK), aggregation=aggregation)
    assert loss.item() == pytest.approx(EXPECTED[aggregation], abs=1e-12)
    loss.backward()
    grad = logprobs.grad
    assert torch.isfinite(grad).all()
    assert grad[1, 2] == 0 and grad[2].eq(0).all()
    if aggregation == "token_mean":
        # d/dlp of -A * exp(lp - old) at ratio 1 is -A = VALUES, divided by 5 tokens.
        assert grad[0].tolist() == pytest.approx([0.2, 0.4, 0.6])
        assert grad[1, :2].tolist() == pytest.approx([0.8, 1.0])
    assert float(metrics["clip_fraction"]) == 0.0
    assert float(metrics["num_tokens"]) == 5


def test_clip_boundary_value_gradient_and_fraction() -> None:
    # A = 2 > 0 on three tokens with old = 0 and lp = 0.1 (inside), 0.25 (on the boundary), 0.5 (beyond).
    # clip_high is chosen as exp(0.25) - 1 so that 1 + clip_high equals the boundary ratio exactly
    # (r - 1 and r - 1 + 1 are exact in floating point for r in [1, 2)).
    # r_in = e^0.1 = 1.1051709, r_b = e^0.25 = 1.2840254, r_out = e^0.5 = 1.6487213 -> clipped to r_b.
    # Loss (token_mean) = -2 * (r_in + r_b + r_b) / 3 = -2 * 3.6732217 / 3 = -2.4488145.
    # Gradient dL/dlp_i = -A * r_i / 3 where the unclipped term binds; 0 where the clipped one binds:
    # inside -2 * 1.1051709 / 3 = -0.7367806; boundary (tie, unclipped kept) -2 * 1.2840254 / 3 = -0.8560169;
    # beyond 0. clip_fraction counts strictly: only the token beyond -> 1/3.
    r_b = math.exp(0.25)
    clip_high = r_b - 1.0
    assert 1.0 + clip_high == r_b
    logprobs = _t([[0.1, 0.25, 0.5]]).requires_grad_()
    loss, metrics = policy_loss(
        logprobs, torch.zeros(1, 3, dtype=F64), _t([2.0]), torch.ones(1, 3), clip_high=clip_high
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2 * (math.exp(0.1) + 2 * r_b) / 3, abs=1e-12)
    assert loss.item() == pytest.approx(-2.4488145, abs=1e-6)
    assert logprobs.grad[0].tolist() == pytest.approx([-2 * math.exp(0.1) / 3, -2 * r_b / 3, 0.0], abs=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_fraction_low"]) == 0.0
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(0.5))
    assert float(metrics["ratio_min"]) == pytest.approx(math.exp(0.1))


def test_negative_advantage_clips_below_and_not_above() -> None:
    # A = -1: ratio 0.5 < 1 - 0.2 binds the clipped term: max(-(-1) * 0.5, 0.8) = 0.8, gradient 0.
    # Ratio 2.0 is NOT clipped for A < 0 (max(2.0, 1.2) = 2.0): gradient -A * r / 2 = 2.0 / 2 = 1.0.
    # Loss = (0.8 + 2.0) / 2 = 1.4; clip_fraction 1/2, all of it on the low side.
    logprobs = _t([[math.log(0.5), math.log(2.0)]]).requires_grad_()
    loss, metrics = policy_loss(logprobs, torch.zeros(1, 2, dtype=F64), _t([-1.0]), torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx(1.4, abs=1e-12)
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 1.0], abs=1e-12)
    assert float(metrics["clip_fraction_low"]) == pytest.approx(0.5)
    assert float(metrics["clip_fraction_high"]) == 0.0


def test_clip_higher_asymmetry() -> None:
    # clip_low 0.2, clip_high 0.28 (DAPO), per-token advantages, old = 0:
    # token 0: A = +1, r = 1.25 -> inside [0.8, 1.28]: loss -1.25, not clipped;
    # token 1: A = -1, r = 0.75 -> below 0.8: loss max(0.75, 0.8) = 0.8, clipped (low);
    # token 2: A = +1, r = 1.30 -> above 1.28: loss max(-1.3, -1.28) = -1.28, clipped (high).
    # token_mean = (-1.25 + 0.8 - 1.28) / 3 = -1.73 / 3 = -0.5766667.
    # Symmetric 0.2 also clips token 0 at 1.2: (-1.2 + 0.8 - 1.2) / 3 = -1.6 / 3 = -0.5333333.
    lp = _t([[math.log(1.25), math.log(0.75), math.log(1.3)]])
    old, adv, mask = torch.zeros(1, 3, dtype=F64), _t([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, metrics = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.73 / 3, abs=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / 3)
    assert float(metrics["clip_fraction_low"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(1 / 3)
    sym_loss, sym_metrics = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert sym_loss.item() == pytest.approx(-1.6 / 3, abs=1e-12)
    assert float(sym_metrics["clip_fraction"]) == pytest.approx(1.0)


def test_dual_clip() -> None:
    # c = 3, old = 0, tokens: (A=-1, r=10), (A=-1, r=2), (A=+1, r=10).
    # Standard per-token losses: max(10, 1.2) = 10; max(2, 1.2) = 2; max(-10, -1.2) = -1.2.
    # Dual clip caps A<0 tokens at -A * c = 3: 10 -> 3 (gradient 0); 2 stays (2 < 3); A>0 untouched.
    # token_mean: with dual (3 + 2 - 1.2) / 3 = 1.2666667; without (10 + 2 - 1.2) / 3 = 3.6.
    # Gradient with dual: [0, -A * r / 3 = 2/3, 0 (clipped)]; dual_clip_fraction 1/3.
    logprobs = _t([[math.log(10.0), math.log(2.0), math.log(10.0)]]).requires_grad_()
    old, adv, mask = torch.zeros(1, 3, dtype=F64), _t([[-1.0, -1.0, 1.0]]), torch.ones(1, 3)
    loss, metrics = policy_loss(logprobs, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert loss.item() == pytest.approx(3.8 / 3, abs=1e-12)
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 2 / 3, 0.0], abs=1e-12)
    assert float(metrics["dual_clip_fraction"]) == pytest.approx(1 / 3)
    plain_loss, plain_metrics = policy_loss(logprobs.detach(), old, adv, mask)
    assert plain_loss.item() == pytest.approx(3.6, abs=1e-12)
    assert "dual_clip_fraction" not in plain_metrics


def test_metrics_hand_numbers_and_detached() -> None:
    # lp = [-1, -2, -3], old = [-1.5, -1.5, -1.5], middle token masked:
    # old - lp on kept tokens = [-0.5, 1.5] -> approx_kl 0.5;
    # ratios exp(0.5) = 1.6487213 and exp(-1.5) = 0.2231302 -> mean 0.9359257, max and min these two.
    logprobs = _t([[-1.0, -2.0, -3.0]]).requires_grad_()
    old = torch.full((1, 3), -1.5, dtype=F64)
    _, metrics = policy_loss(logprobs, old, _t([1.0]), torch.tensor([[1, 0, 1]]))
    assert float(metrics["approx_kl"]) == pytest.approx(0.5)
    assert float(metrics["ratio_mean"]) == pytest.approx((math.exp(0.5) + math.exp(-1.5)) / 2)
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(0.5))
    assert float(metrics["ratio_min"]) == pytest.approx(math.exp(-1.5))
    assert float(metrics["num_tokens"]) == 2
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("aggregation", list(EXPECTED))
def test_all_masked_batch_gives_zero_loss_zero_grad(aggregation: str) -> None:
    logprobs = torch.full((2, 3), NAN, dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(
        logprobs,
        torch.zeros(2, 3, dtype=F64),
        _t([1.0, -1.0]),
        torch.zeros(2, 3),
        aggregation=aggregation,
        dual_clip=3.0,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 3, dtype=F64))
    assert all(float(v) == 0.0 for v in metrics.values())


def test_old_logprobs_and_advantages_are_constants() -> None:
    # On-policy single step: passing the same tensor as logprobs and old_logprobs must still give the
    # policy gradient -A / N per token (old is detached); without detaching, the ratio would be constant 1.
    logprobs = _t([[-0.5, -0.7]]).requires_grad_()
    adv = _t([3.0]).requires_grad_()
    loss, _ = policy_loss(logprobs, logprobs, adv, torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert logprobs.grad[0].tolist() == pytest.approx([-1.5, -1.5])
    assert adv.grad is None


def test_diverged_ratio_gives_finite_values() -> None:
    # A log-ratio of 200 would overflow exp in float32; the clamp at 20 keeps loss and gradient finite.
    logprobs = torch.tensor([[200.0, 0.0]], requires_grad=True)
    loss, metrics = policy_loss(
        logprobs, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), dual_clip=3.0
    )
    loss.backward()
    # Dual clip caps the diverged token at 3; the other is -A * 1 = 1: (3 + 1) / 2 = 2.
    assert loss.item() == pytest.approx(2.0)
    assert torch.isfinite(logprobs.grad).all()
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(20.0), rel=1e-5)


def test_bf16_logprobs_computed_in_float32() -> None:
    lp = torch.zeros(1, 2, dtype=torch.bfloat16)
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2))
    assert loss.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"old_logprobs": torch.zeros(2, 4)}, r"old_logprobs shape \(2, 4\) != logprobs shape \(2, 3\)"),
        ({"mask": torch.ones(3, 3)}, r"mask shape \(3, 3\)"),
        ({"advantages": torch.zeros(3)}, r"advantages must be \[B\]=2"),
        ({"advantages": torch.zeros(2, 4)}, r"advantages must be"),
        (
            {"logprobs": torch.zeros(6), "old_logprobs": torch.zeros(6), "mask": torch.ones(6)},
            r"logprobs must be \[B, T\]",
        ),
        ({"aggregation": "mean"}, r"unknown aggregation 'mean'.*seq_mean_token_sum_norm"),
        ({"clip_low": 1.0}, "clip_low must be in"),
        ({"clip_high": -0.1}, "clip_high must be >= 0"),
        ({"dual_clip": 1.0}, "dual_clip must be > 1"),
        ({"num_sequences": -2}, "num_sequences must be >= 0"),
    ],
)
def test_policy_loss_bad_inputs(kwargs: dict, match: str) -> None:
    args = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3),
    }
    args.update(kwargs)
    positional = [args.pop(k) for k in ("logprobs", "old_logprobs", "advantages", "mask")]
    with pytest.raises(ValueError, match=match):
        policy_loss(*positional, **args)


@settings(max_examples=50, deadline=None)
@given(
    data=st.integers(1, 4).flatmap(
        lambda b: st.integers(1, 4).flatmap(
            lambda t: st.tuples(
                st.lists(st.floats(-3, 3, allow_nan=False), min_size=b * t, max_size=b * t),
                st.lists(st.floats(-5, 0, allow_nan=False), min_size=b * t, max_size=b * t),
                st.lists(st.booleans(), min_size=b * t, max_size=b * t),
                st.just((b, t)),
            )
        )
    )
)
def test_property_ratio_one_loss_is_minus_mean_advantage(data: tuple) -> None:
    # At ratio 1 every clip is inactive, so token_mean loss = -(masked mean of A) and clip_fraction = 0.
    adv_list, lp_list, mask_list, shape = data
    adv, lp = _t(adv_list).reshape(shape), _t(lp_list).reshape(shape)
    mask = torch.tensor(mask_list).reshape(shape)
    loss, metrics = policy_loss(lp, lp.clone(), adv, mask, clip_low=0.1, clip_high=0.3, dual_clip=2.0)
    assert loss.item() == pytest.approx(-float(masked_mean(adv, mask)), abs=1e-12)
    assert float(metrics["clip_fraction"]) == 0.0


# ----------------------------------------------------------------------------------------------------
# kl_penalty
# ----------------------------------------------------------------------------------------------------


def test_kl_hand_numbers() -> None:
    # (lp, ref) = (-1, -2): lp - ref = 1  -> k1 = 1, k2 = 0.5, k3 = e^-1 - (-1) - 1 = 0.3678794.
    # (lp, ref) = (-2, -1): lp - ref = -1 -> k1 = -1, k2 = 0.5, k3 = e^1 - 1 - 1 = 0.7182818.
    # (lp, ref) = (-3, -3): all zero.
    lp, ref = _t([-1.0, -2.0, -3.0]), _t([-2.0, -1.0, -3.0])
    assert kl_penalty(lp, ref, "k1").tolist() == pytest.approx([1.0, -1.0, 0.0])
    assert kl_penalty(lp, ref, "k2").tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert kl_penalty(lp, ref, "k3").tolist() == pytest.approx([math.exp(-1), math.e - 2, 0.0], abs=1e-12)
    assert kl_penalty(lp, ref, "k3")[0] == pytest.approx(0.3678794, abs=1e-7)
    assert set(KL_KINDS) == {"k1", "k2", "k3"}


def test_k3_gradient() -> None:
    # k3 = e^d - d - 1 with d = ref - lp: dk3/dlp = 1 - e^d. At lp = -1, ref = -2: 1 - e^-1 = 0.6321206.
    lp = _t([-1.0]).requires_grad_()
    kl_penalty(lp, _t([-2.0]), "k3").sum().backward()
    assert float(lp.grad) == pytest.approx(1 - math.exp(-1), abs=1e-12)


def test_k3_clamp() -> None:
    # d = ref - lp = 10: e^10 - 11 = 22015.5 -> 10. d = -1000: 0 + 1000 - 1 = 999 -> 10.
    # d = 1000 would overflow exp; still exactly 10 with a zero, finite gradient.
    lp = _t([-10.0, 0.0, -1000.0]).requires_grad_()
    ref = _t([0.0, -1000.0, 0.0])
    k3 = kl_penalty(lp, ref, "k3")
    k3.sum().backward()
    assert k3.tolist() == [10.0, 10.0, 10.0]
    assert torch.equal(lp.grad, torch.zeros(3, dtype=F64))


def test_kl_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"unknown KL kind 'k4'.*'k1', 'k2', 'k3'"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 2), "k1")


# ----------------------------------------------------------------------------------------------------
# entropy_from_logits / token_logprobs
# ----------------------------------------------------------------------------------------------------


def test_entropy_uniform_is_log_vocab() -> None:
    # Uniform over V = 7 (any constant logit): H = log 7 = 1.9459101.
    for logits in (torch.zeros(2, 3, 7), torch.full((2, 3, 7), 42.0)):
        h = entropy_from_logits(logits)
        assert h.shape == (2, 3)
        assert torch.allclose(h, torch.full((2, 3), math.log(7)), atol=1e-6)


def test_entropy_hand_distribution_and_bf16() -> None:
    # p = [1/2, 1/4, 1/4]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 1.5 ln 2 = 1.0397208.
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    assert float(entropy_from_logits(logits)) == pytest.approx(1.5 * math.log(2), abs=1e-6)
    # bf16 in, float32 out; zeros are exact in bf16, so H = log 3 = 1.0986123 exactly as in float32.
    h = entropy_from_logits(torch.zeros(4, 3, dtype=torch.bfloat16))
    assert h.dtype == torch.float32
    assert torch.allclose(h, torch.full((4,), math.log(3)), atol=1e-6)


def test_entropy_extreme_logits_finite_gradient() -> None:
    # p of the 0-logits is e^-1000, underflowing to 0: H ~ 0 and the gradient must stay finite (p log p
    # formulations give log 0 there).
    logits = torch.tensor([[1000.0, 0.0, 0.0]], requires_grad=True)
    h = entropy_from_logits(logits)
    h.sum().backward()
    assert h.item() == pytest.approx(0.0, abs=1e-4)
    assert torch.isfinite(logits.grad).all()


def test_token_logprobs_hand_numbers_and_gradient() -> None:
    # logits [0, ln 3, 0] -> softmax [1/5, 3/5, 1/5]: log p(1) = ln 0.6 = -0.5108256,
    # log p(0) = ln 0.2 = -1.6094379. Gradient of log p(1) w.r.t. logits = onehot(1) - softmax
    # = [-0.2, 0.4, -0.2].
    logits = _t([[[0.0, math.log(3), 0.0], [0.0, math.log(3), 0.0]]]).requires_grad_()
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp[0].tolist() == pytest.approx([math.log(0.6), math.log(0.2)], abs=1e-12)
    lp[0, 0].backward()
    assert logits.grad[0, 0].tolist() == pytest.approx([-0.2, 0.4, -0.2], abs=1e-12)
    assert logits.grad[0, 1].eq(0).all()


def test_token_logprobs_matches_log_softmax_and_handles_extremes() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=gen) * 5
    ids = torch.randint(0, 11, (2, 3), generator=gen)
    expected = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, ids), expected, atol=1e-5)
    # bf16 logits -> float32 result equal to the float32 computation on the same (bf16-exact) values.
    bf = logits.to(torch.bfloat16)
    out = token_logprobs(bf, ids)
    assert out.dtype == torch.float32
    assert torch.allclose(out, token_logprobs(bf.float(), ids), atol=1e-6)
    # [1000, 0]: log p(0) = -log(1 + e^-1000) = 0, log p(1) = -1000; no overflow.
    big = token_logprobs(torch.tensor([[[1000.0, 0.0], [1000.0, 0.0]]]), torch.tensor([[0, 1]]))
    assert big[0].tolist() == pytest.approx([0.0, -1000.0])


def test_token_logprobs_bad_inputs() -> None:
    with pytest.raises(ValueError, match="integer tensor"):
        token_logprobs(torch.zeros(1, 2, 5), torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"logits \(1, 3, 5\), token_ids \(1, 2\)"):
        token_logprobs(torch.zeros(1, 3, 5), torch.zeros(1, 2, dtype=torch.long))


def test_the_policy_loss_goes_by_its_design_name_in_losses() -> None:
    """`losses.policy_loss` (the design's name) is the policy loss of `policy_losses`: PPO at ratio 1 with advantage
    +1 on two tokens is -1 (the token mean of -A * r)."""
    from visionrl.algo import losses, policy_losses

    assert losses.policy_loss is policy_losses.policy_loss
    lp = torch.zeros(1, 2)
    loss, metrics = losses.policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2))
    assert float(loss) == -1.0 and metrics["clip_fraction"] == 0.0
