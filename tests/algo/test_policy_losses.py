"""Tests of the policy-loss kinds GSPO, CISPO, SAPO and per-token weights (visionrl.algo.policy_losses).

PPO itself is covered in test_losses.py; here kind="ppo" only appears as the contrast the others differ from.
"""

from __future__ import annotations

import math

import pytest
import torch

from visionrl.algo import AGGREGATIONS, LOSS_KINDS, policy_loss

F64 = torch.float64
NAN = float("nan")
LN = math.log


def _t(rows: list[list[float]] | list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_loss_kinds_are_the_four_variants() -> None:
    assert LOSS_KINDS == ("ppo", "gspo", "cispo", "sapo")


# ----------------------------------------------------------------------------------------------------
# GSPO
# ----------------------------------------------------------------------------------------------------


def test_gspo_hand_numbers_both_signs_across_the_clip() -> None:
    # Four rows, clip 0.2 / 0.2, token_mean over N = 2 + 3 + 3 + 1 = 9 tokens; m_i = mean of lp - old.
    # row 0: A = +1, lp - old = [0.05, 0.15] (third masked, NaN) -> m = 0.1, s = e^0.1 = 1.1051709 inside:
    #        loss -s per token, gradient -A s / 9 = -0.1227968 on BOTH tokens although their lp differ.
    # row 1: A = +1, lp - old = 0.2 x 3 -> s = e^0.2 = 1.2214028 > 1.2: clipped, loss -1.2, gradient 0.
    # row 2: A = -1, lp - old = [-0.5, -1, 0] -> m = -0.5, s = e^-0.5 = 0.6065307 < 0.8: clipped,
    #        loss max(0.6065, 0.8) = 0.8, gradient 0.
    # row 3: A = -1, lp = -0.5, old = -1 (one token) -> s = e^0.5 = 1.6487213: A < 0 is not clipped
    #        above, loss 1.6487213, gradient -A s / 9 = 0.1831912.
    # loss = (-2 e^0.1 - 3 * 1.2 + 3 * 0.8 + e^0.5) / 9 = -1.7616206 / 9 = -0.1957356.
    # clip_fraction 6/9 (3 low, 3 high); approx_kl = -(0.2 + 0.6 - 1.5 + 0.5) / 9 = 0.2 / 9.
    lp = _t([[0.05, 0.15, NAN], [0.2, 0.2, 0.2], [-0.5, -1.0, 0.0], [-0.5, NAN, NAN]]).requires_grad_()
    old = _t([[0.0, 0.0, NAN], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0]])
    loss, metrics = policy_loss(lp, old, _t([1.0, 1.0, -1.0, -1.0]), mask, kind="gspo")
    loss.backward()
    e1, e5 = math.exp(0.1), math.exp(0.5)
    assert loss.item() == pytest.approx((-2 * e1 - 3.6 + 2.4 + e5) / 9, abs=1e-12)
    assert loss.item() == pytest.approx(-0.1957356, abs=1e-6)
    expected = [[-e1 / 9, -e1 / 9, 0.0], [0.0] * 3, [0.0] * 3, [e5 / 9, 0.0, 0.0]]
    assert torch.allclose(lp.grad, _t(expected), atol=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(6 / 9)
    assert float(metrics["clip_fraction_low"]) == pytest.approx(3 / 9)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(3 / 9)
    assert float(metrics["approx_kl"]) == pytest.approx(0.2 / 9, abs=1e-12)
    assert float(metrics["ratio_max"]) == pytest.approx(e5)
    assert float(metrics["ratio_min"]) == pytest.approx(math.exp(-0.5))
    ratio_mean = (2 * e1 + 3 * math.exp(0.2) + 3 * math.exp(-0.5) + e5) / 9
    assert float(metrics["ratio_mean"]) == pytest.approx(ratio_mean, abs=1e-12)


def test_gspo_tie_at_the_boundary_keeps_the_gradient() -> None:
    # lp - old = [0.25, 0.25] -> m = 0.25 exactly; clip_high = e^0.25 - 1 makes 1 + clip_high == s, a tie:
    # the unclipped term is kept (gradient -A s / 2 per token with A = 2: -e^0.25 = -1.2840254) and the
    # token is not counted as clipped. With clip_high 1e-12 smaller it clips: gradient 0.
    s = math.exp(0.25)
    clip_high = s - 1.0
    assert 1.0 + clip_high == s
    lp = _t([[0.25, 0.25]]).requires_grad_()
    loss, metrics = policy_loss(
        lp, torch.zeros(1, 2, dtype=F64), _t([2.0]), torch.ones(1, 2), kind="gspo", clip_high=clip_high
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2 * s, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([-s, -s], abs=1e-12)
    assert float(metrics["clip_fraction"]) == 0.0
    lp2 = lp.detach().clone().requires_grad_()
    smaller = clip_high - 1e-12
    loss2, metrics2 = policy_loss(
        lp2, torch.zeros(1, 2, dtype=F64), _t([2.0]), torch.ones(1, 2), kind="gspo", clip_high=smaller
    )
    loss2.backward()
    assert lp2.grad[0].tolist() == [0.0, 0.0]
    assert float(metrics2["clip_fraction"]) == 1.0


def _gspo_reference(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Sequence-level GSPO written independently: s_i = exp(mean of the row's log-ratios) with its true
    gradient, per-sequence clipped surrogate, mean over non-empty rows (clip 0.2 / 0.2)."""
    losses = []
    for i in range(lp.shape[0]):
        rows = [t for t in range(lp.shape[1]) if mask[i, t]]
        if not rows:
            continue
        m = sum(lp[i, t] - old[i, t] for t in rows) / len(rows)
        s = torch.exp(m)
        losses.append(torch.maximum(-adv[i] * s, -adv[i] * torch.clamp(s, 0.8, 1.2)))
    return torch.stack(losses).mean()


def test_gspo_gradient_equals_the_sequence_objective() -> None:
    # With seq_mean_token_mean, GSPO's per-token form (value s_i, gradient through each token's lp,
    # averaged over the row's n_i tokens) must give exactly the gradient of the sequence-level objective
    # max(-A s_i, -A clip(s_i)) with d s_i / d lp_t = s_i / n_i. Row 3 is fully masked and holds NaN.
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([4, 1, 3, 0, 2, 4])
    mask = (torch.arange(4)[None, :] < lengths[:, None]).to(F64)
    base = -torch.rand(6, 4, generator=gen, dtype=F64)
    old = base - 0.4 * torch.randn(6, 4, generator=gen, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3], dtype=F64)
    base[3], old[3] = NAN, NAN
    lp = base.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, kind="gspo", aggregation="seq_mean_token_mean")
    loss.backward()
    ref_lp = base.clone().requires_grad_()
    ref = _gspo_reference(ref_lp, old, adv, mask)
    ref.backward()
    ref_grad = torch.where(mask.bool(), ref_lp.grad, 0.0)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(lp.grad, ref_grad, atol=1e-12)
    assert lp.grad[3].eq(0).all() and torch.isfinite(lp.grad).all()
    # The draw clips some rows and not others, so both branches of the max are exercised.
    assert 0 < float(metrics["clip_fraction"]) < 1


def test_gspo_sequence_log_ratio_capped_at_10() -> None:
    # lp - old = 12 on both tokens -> m = 12, capped: s = e^10 = 22026.466; A = -1 is not clipped above,
    # loss = e^10, and the cap gives a zero (finite) gradient.
    lp = _t([[12.0, 12.0]]).requires_grad_()
    loss, metrics = policy_loss(lp, torch.zeros(1, 2, dtype=F64), _t([-1.0]), torch.ones(1, 2), kind="gspo")
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12)
    assert lp.grad.eq(0).all()
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(10.0), rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# CISPO
# ----------------------------------------------------------------------------------------------------


def test_cispo_hand_numbers_gradient_survives_the_clip() -> None:
    # old = 0, clip 0.2 / 0.2 -> weight range [0.8, 1.2]; per-token A; token_mean over 4 tokens.
    # token 0: A = +1, r = 1.1 inside: w = 1.1, loss -1.1 ln 1.1 = -0.1048412, gradient -w A / 4 = -0.275.
    # token 1: A = +1, r = 1.5 above:  w = 1.2, loss -1.2 ln 1.5 = -0.4865581, gradient -0.3 (PPO: 0).
    # token 2: A = -1, r = 0.5 below:  w = 0.8, loss 0.8 ln 0.5 = -0.5545177, gradient +0.2 (PPO: 0).
    # token 3: A = -1, r = 2.0 above:  w = 1.2, loss 1.2 ln 2 = 0.8317766, gradient +0.3 (PPO: -A r / 4 = 0.5).
    # loss = (-0.1048412 - 0.4865581 - 0.5545177 + 0.8317766) / 4 = -0.0785351.
    # clip_fraction 3/4: below the range 1/4 (token 2), above 2/4 (tokens 1 and 3).
    values = [LN(1.1), LN(1.5), LN(0.5), LN(2.0)]
    adv, old, mask = _t([[1.0, 1.0, -1.0, -1.0]]), torch.zeros(1, 4, dtype=F64), torch.ones(1, 4)
    lp = _t([values]).requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, kind="cispo")
    loss.backward()
    expected = (-1.1 * LN(1.1) - 1.2 * LN(1.5) + 0.8 * LN(0.5) + 1.2 * LN(2.0)) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(-0.0785351, abs=1e-6)
    assert lp.grad[0].tolist() == pytest.approx([-0.275, -0.3, 0.2, 0.3], abs=1e-12)
    assert float(metrics["clip_fraction"]) == pytest.approx(0.75)
    assert float(metrics["clip_fraction_low"]) == pytest.approx(0.25)
    assert float(metrics["clip_fraction_high"]) == pytest.approx(0.5)
    # The contrast: PPO's clipped tokens 1 and 2 get no gradient at all.
    ppo_lp = _t([values]).requires_grad_()
    policy_loss(ppo_lp, old, adv, mask, kind="ppo")[0].backward()
    assert ppo_lp.grad[0].tolist() == pytest.approx([-1.1 / 4, 0.0, 0.0, 0.5], abs=1e-12)


def test_cispo_boundaries_are_not_clipped() -> None:
    # r exactly 1 + clip_high (lp = 0.25) and exactly 1 - clip_low (lp = -0.25): the clamp changes neither,
    # so clip_fraction is 0 and the weights are r themselves: gradient -r A / 2 with A = 1.
    r_hi, r_lo = math.exp(0.25), math.exp(-0.25)
    clip_high, clip_low = r_hi - 1.0, 1.0 - r_lo
    assert 1.0 + clip_high == r_hi and 1.0 - clip_low == r_lo
    lp = _t([[0.25, -0.25]]).requires_grad_()
    old = torch.zeros(1, 2, dtype=F64)
    loss, metrics = policy_loss(
        lp, old, _t([1.0]), torch.ones(1, 2), kind="cispo", clip_low=clip_low, clip_high=clip_high
    )
    assert float(metrics["clip_fraction"]) == 0.0
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-r_hi / 2, -r_lo / 2], abs=1e-12)


def test_cispo_without_a_lower_bound_keeps_the_small_ratio() -> None:
    # MiniMax-M1's CISPO bounds the weight above only. old = 0, clip_low None, clip_high 0.2, A = -1, token_mean
    # over 2 tokens. token 0: r = 0.1 (the policy now finds it 10x less likely): w = 0.1, not 1 - 0.2 = 0.8, so
    # its gradient is -w A / 2 = +0.05 (with the lower bound: +0.4, 8x). token 1: r = 1.5: w = 1.2, gradient +0.6.
    # clip_fraction 1/2 (token 1, above); nothing can be clipped below.
    lp = _t([[LN(0.1), LN(1.5)]]).requires_grad_()
    old, mask = torch.zeros(1, 2, dtype=F64), torch.ones(1, 2)
    loss, metrics = policy_loss(lp, old, _t([-1.0]), mask, kind="cispo", clip_low=None)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.05, 0.6], abs=1e-12)
    assert float(metrics["clip_fraction_low"]) == 0.0 and float(metrics["clip_fraction_high"]) == 0.5
    bounded = _t([[LN(0.1), LN(1.5)]]).requires_grad_()
    policy_loss(bounded, old, _t([-1.0]), mask, kind="cispo", clip_low=0.2)[0].backward()
    assert bounded.grad[0].tolist() == pytest.approx([0.4, 0.6], abs=1e-12)
    with pytest.raises(
        ValueError, match="clip_low=None"
    ):  # PPO's A < 0 tokens would be pushed down unbounded
        policy_loss(lp, old, _t([-1.0]), mask, kind="ppo", clip_low=None)


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage() -> None:
    # On random data with ragged masks: dL/dlp_t = -clip(exp(lp - old), 0.8, 1.28) * A / N on every
    # unmasked token (N = 11), whether clipped or not; 0 on padding.
    gen = torch.Generator().manual_seed(5)
    lengths = torch.tensor([4, 0, 3, 4])
    mask = torch.arange(4)[None, :] < lengths[:, None]
    base = -torch.rand(4, 4, generator=gen, dtype=F64)
    old = base - 0.5 * torch.randn(4, 4, generator=gen, dtype=F64)
    adv = torch.randn(4, 4, generator=gen, dtype=F64)
    lp = torch.where(mask, base, NAN).requires_grad_()
    loss, metrics = policy_loss(lp, old, adv, mask, kind="cispo", clip_high=0.28)
    loss.backward()
    expected = torch.where(mask, -(base - old).exp().clamp(0.8, 1.28) * adv / 11, 0.0)
    assert torch.allclose(lp.grad, expected, atol=1e-12)
    assert 0 < float(metrics["clip_fraction"]) < 1


# ----------------------------------------------------------------------------------------------------
# SAPO
# ----------------------------------------------------------------------------------------------------


def test_sapo_at_ratio_one_matches_the_policy_gradient() -> None:
    # loss = -A (4 / tau) sigmoid(tau (r - 1)); at r = 1 sigmoid(0) = 1/2, so the value is -2 A / tau, and
    # d/dlp = -A (4 / tau) sigmoid'(0) tau r = -A (4 / tau) (1/4) tau = -A: tau cancels, as in PPO.
    # Defaults tau_pos = 1, tau_neg = 1.05; A = [2, -1] -> values [-4, 2 / 1.05 = 1.9047619],
    # loss (token_mean) = (-4 + 1.9047619) / 2 = -1.0476190, gradient -A / 2 = [-1, 0.5].
    lp = _t([[-0.3, -1.2]]).requires_grad_()
    loss, metrics = policy_loss(lp, lp.detach().clone(), _t([[2.0, -1.0]]), torch.ones(1, 2), kind="sapo")
    loss.backward()
    assert loss.item() == pytest.approx((-4.0 + 2.0 / 1.05) / 2, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([-1.0, 0.5], abs=1e-12)
    assert float(metrics["gate_mean"]) == pytest.approx(1.0, abs=1e-12)
    assert float(metrics["clip_fraction"]) == 0.0


def test_sapo_hand_numbers_off_policy() -> None:
    # tau_pos = 1, tau_neg = 2, old = 0. d/dlp = -A 4 g (1 - g) r with g = sigmoid(tau (r - 1)).
    # token 0: A = +1, r = 2:   g = sigmoid(1) = 0.7310586; value -4 g = -2.9242344;
    #          gradient -4 g (1 - g) * 2 = -4 * 0.1966119 * 2 = -1.5728954 (before / N).
    # token 1: A = -1, r = 0.5: g = sigmoid(-1) = 0.2689414; value (4 / 2) g = 0.5378828;
    #          gradient +4 g (1 - g) * 0.5 = 0.3932239.
    # token_mean: loss (-2.9242344 + 0.5378828) / 2 = -1.1931758; gradient [-0.7864477, 0.1966119].
    # gate_mean = 4 g (1 - g) = 0.7864477 on both tokens.
    g = 1 / (1 + math.exp(-1.0))
    lp = _t([[LN(2.0), LN(0.5)]]).requires_grad_()
    loss, metrics = policy_loss(
        lp, torch.zeros(1, 2, dtype=F64), _t([[1.0, -1.0]]), torch.ones(1, 2), kind="sapo", tau_neg=2.0
    )
    loss.backward()
    assert loss.item() == pytest.approx((-4 * g + 2 * (1 - g)) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(-1.1931758, abs=1e-6)
    gate = 4 * g * (1 - g)
    assert lp.grad[0].tolist() == pytest.approx([-gate * 2 / 2, gate * 0.5 / 2], abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([-0.7864477, 0.1966119], abs=1e-6)
    assert float(metrics["gate_mean"]) == pytest.approx(gate, abs=1e-12)


def test_sapo_gradient_is_smooth_across_the_ppo_clip_boundary() -> None:
    # A = +1 at r = 1.2 -/+ 1e-6: PPO's gradient jumps from -r to 0, SAPO's stays -4 g (1 - g) r with
    # g = sigmoid(0.2): 4 * 0.5498340 * 0.4501660 * 1.2 = 1.1880795, the same on both sides to ~1e-6.
    g = 1 / (1 + math.exp(-0.2))
    old, adv, mask = torch.zeros(1, 2, dtype=F64), _t([1.0]), torch.ones(1, 2)
    grads = {}
    for kind in ("ppo", "sapo"):
        lp = _t([[LN(1.2 - 1e-6), LN(1.2 + 1e-6)]]).requires_grad_()
        policy_loss(lp, old, adv, mask, kind=kind, aggregation="seq_mean_token_sum")[0].backward()
        grads[kind] = lp.grad[0].tolist()
    assert grads["ppo"] == pytest.approx([-1.2, 0.0], abs=1e-5)
    assert grads["sapo"] == pytest.approx([-4 * g * (1 - g) * 1.2] * 2, abs=1e-5)
    assert grads["sapo"][0] == pytest.approx(-1.1880795, abs=1e-5)


def test_sapo_gradient_matches_autograd_of_reference() -> None:
    # Independent float64 reference: token_mean of -A (4 / tau) sigmoid(tau (exp(lp - old) - 1)).
    gen = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]).bool()
    base = -torch.rand(3, 3, generator=gen, dtype=F64)
    old = base - 0.6 * torch.randn(3, 3, generator=gen, dtype=F64)
    adv = torch.randn(3, 3, generator=gen, dtype=F64)
    lp = torch.where(mask, base, NAN).requires_grad_()
    loss, _ = policy_loss(lp, old, adv, mask, kind="sapo", tau_pos=1.5, tau_neg=3.0)
    loss.backward()
    ref_lp = base.clone().requires_grad_()
    tau = torch.where(adv > 0, 1.5, 3.0).to(F64)
    per_token = -adv * (4 / tau) * torch.sigmoid(tau * (torch.exp(ref_lp - old) - 1))
    ref = per_token[mask].sum() / mask.sum()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(lp.grad, torch.where(mask, ref_lp.grad, 0.0), atol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Shared behaviour: weights, masking, validation
# ----------------------------------------------------------------------------------------------------


def test_weights_multiply_per_token_losses() -> None:
    # PPO at ratio 1: per-token loss -A = -1; weights [0.5, 2, NaN under the mask] -> loss
    # (-0.5 - 2) / 2 = -1.25, gradient -A w / 2 = [-0.25, -1, 0]; the weights get no gradient.
    lp = _t([[-1.0, -2.0, NAN]]).requires_grad_()
    weights = _t([[0.5, 2.0, NAN]]).requires_grad_()
    loss, _ = policy_loss(lp, lp.detach().clone(), _t([1.0]), torch.tensor([[1, 1, 0]]), weights=weights)
    loss.backward()
    assert loss.item() == pytest.approx(-1.25, abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx([-0.25, -1.0, 0.0], abs=1e-12)
    assert weights.grad is None


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_weights_scale_each_token_for_every_kind(kind: str) -> None:
    # Per-token losses are multiplied before aggregation, so weights [3, 0] give 3x the loss and gradient
    # of token 0 alone (token_mean still divides by the 2 unmasked tokens), and token 1 gets no gradient.
    base, old = _t([[-0.4, -0.9]]), _t([[-0.6, -0.5]])
    adv = _t([[1.5, -0.5]])
    full = base.clone().requires_grad_()
    loss_w, _ = policy_loss(full, old, adv, torch.ones(1, 2), kind=kind, weights=_t([[3.0, 0.0]]))
    loss_w.backward()
    single = base.clone().requires_grad_()
    loss_1, _ = policy_loss(single, old, adv, torch.ones(1, 2), kind=kind, weights=_t([[1.0, 0.0]]))
    loss_1.backward()
    assert loss_1.item() != 0.0
    assert loss_w.item() == pytest.approx(3 * loss_1.item(), abs=1e-12)
    assert full.grad[0].tolist() == pytest.approx((3 * single.grad[0]).tolist(), abs=1e-12)
    # Even for GSPO: token 1 moves the row's ratio only through the stop-gradient m_i.
    assert full.grad[0, 1] == 0.0


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_fully_masked_row_changes_nothing(kind: str) -> None:
    # Row 1 is fully masked and holds NaN everywhere: the loss and gradient of row 0 are those of row 0
    # alone, row 1's gradient is exactly 0, every metric is finite.
    base, old = _t([[-0.4, -0.9]]), _t([[-0.7, -0.5]])
    alone = base.clone().requires_grad_()
    loss_alone, _ = policy_loss(alone, old, _t([1.0]), torch.ones(1, 2), kind=kind)
    loss_alone.backward()
    lp = torch.cat([base, _t([[NAN, NAN]])]).requires_grad_()
    both_old = torch.cat([old, _t([[NAN, NAN]])])
    loss, metrics = policy_loss(lp, both_old, _t([1.0, NAN]), torch.tensor([[1, 1], [0, 0]]), kind=kind)
    loss.backward()
    assert loss.item() == pytest.approx(loss_alone.item(), abs=1e-12)
    assert lp.grad[0].tolist() == pytest.approx(alone.grad[0].tolist(), abs=1e-12)
    assert lp.grad[1].tolist() == [0.0, 0.0]
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("kind", LOSS_KINDS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_masked_batch_is_zero_for_every_kind(kind: str, aggregation: str) -> None:
    lp = torch.full((2, 3), NAN, dtype=F64, requires_grad=True)
    loss, metrics = policy_loss(
        lp,
        torch.zeros(2, 3, dtype=F64),
        _t([1.0, -1.0]),
        torch.zeros(2, 3),
        kind=kind,
        aggregation=aggregation,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(lp.grad, torch.zeros(2, 3, dtype=F64))
    assert {"clip_fraction", "approx_kl"} <= set(metrics)
    assert all(float(v) == 0.0 for v in metrics.values())
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize(("kind", "dual_clip"), [*((kind, None) for kind in LOSS_KINDS), ("ppo", 2.0)])
def test_micro_batch_additivity_for_every_kind(kind: str, dual_clip: float | None) -> None:
    # Six rows of response lengths [5, 3, 0, 2, 4, 1] padded to T = 5, split into rows 0-1 and rows 2-5, the
    # second padded only to its own longest length 4 (as a token-budget batcher would). With the global
    # normalisers (15 tokens, 5 non-empty rows, norm_length 5 = the full batch's T) the micro-batch losses
    # sum to the full-batch loss and gradient, for every aggregation (and with PPO's dual clip).
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 0, 2, 4, 1])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).to(F64)
    logprobs = -torch.rand(6, 5, generator=gen, dtype=F64)
    old = logprobs - 0.3 * torch.randn(6, 5, generator=gen, dtype=F64)
    adv = torch.randn(6, generator=gen, dtype=F64)
    weights = torch.rand(6, 5, generator=gen, dtype=F64) + 0.5
    norms = {"num_tokens": 15.0, "num_sequences": 5.0, "norm_length": 5.0}
    for aggregation in AGGREGATIONS:
        full_lp = logprobs.clone().requires_grad_()
        full, _ = policy_loss(
            full_lp, old, adv, mask, kind=kind, weights=weights, aggregation=aggregation, dual_clip=dual_clip
        )
        full.backward()
        micro_lp = logprobs.clone().requires_grad_()
        total = torch.zeros((), dtype=F64)
        for rows, t in ((slice(0, 2), 5), (slice(2, 6), 4)):
            part, _ = policy_loss(
                micro_lp[rows, :t],
                old[rows, :t],
                adv[rows],
                mask[rows, :t],
                kind=kind,
                weights=weights[rows, :t],
                aggregation=aggregation,
                dual_clip=dual_clip,
                **norms,
            )
            total = total + part
        total.backward()
        assert total.item() == pytest.approx(full.item(), abs=1e-12), aggregation
        assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-12), aggregation
        assert full_lp.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["gspo", "cispo", "sapo"])
def test_dual_clip_only_with_ppo(kind: str) -> None:
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2))
    with pytest.raises(ValueError, match=rf"dual_clip applies only to kind in \['ppo'\], got kind='{kind}'"):
        policy_loss(*args, kind=kind, dual_clip=3.0)
    policy_loss(*args, kind="ppo", dual_clip=3.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "grpo"}, r"unknown policy loss kind 'grpo'.*'ppo', 'gspo', 'cispo', 'sapo'"),
        ({"weights": torch.ones(2, 4)}, r"weights shape \(2, 4\) != logprobs shape \(2, 3\)"),
        ({"tau_pos": 0.0}, "tau_pos must be > 0"),
        ({"tau_neg": -1.0}, "tau_neg must be > 0"),
    ],
)
def test_bad_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), **kwargs)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_bf16_inputs_computed_in_float32(kind: str) -> None:
    lp = torch.zeros(1, 2, dtype=torch.bfloat16)
    loss, metrics = policy_loss(lp, lp, torch.tensor([1.0]), torch.ones(1, 2), kind=kind)
    assert loss.dtype == torch.float32 and metrics["approx_kl"].dtype == torch.float32
