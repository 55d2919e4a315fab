"""Tests of visionrl.algo.rollout_correction: token / sequence level x truncate / mask, numbers by hand."""

from __future__ import annotations

import math

import pytest
import torch

from visionrl.algo import CORRECTION_LEVELS, policy_loss, rollout_correction

F64 = torch.float64
NAN = float("nan")
LN = math.log
# The boundary weights are computed exactly as the module does (exp of the same float64 log-ratio), so a
# weight can sit exactly on threshold / lower; exp(ln 2) need not be 2.0 to the last bit.
TWO = float(torch.tensor(LN(2.0), dtype=F64).exp())
HALF = float(torch.tensor(LN(0.5), dtype=F64).exp())

# Row 0: d = lp - rollout = [ln 0.5, ln 2, ln 3] (rollout 0). Row 1: d = [0, ln 1.5] with rollout -1, and a
# masked third position holding NaN in both inputs. N = 5 unmasked tokens.
LP = [[LN(0.5), LN(2.0), LN(3.0)], [-1.0, -1.0 + LN(1.5), NAN]]
ROLLOUT = [[0.0, 0.0, 0.0], [-1.0, -1.0, NAN]]
MASK = [[1, 1, 1], [1, 1, 0]]
# k3 = e^d - d - 1 summed over the 5 tokens: sum e^d = 0.5 + 2 + 3 + 1 + 1.5 = 8,
# sum d = ln(0.5 * 2 * 3 * 1 * 1.5) = ln 4.5 = 1.5040774, so (8 - 1.5040774 - 5) / 5 = 0.2991845.
MISMATCH_KL = (8.0 - LN(4.5) - 5.0) / 5


def _close(x: torch.Tensor, expected: list[list[float]]) -> bool:
    return torch.allclose(x.to(F64), torch.tensor(expected, dtype=F64), rtol=0.0, atol=1e-12)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.tensor(LP, dtype=F64), torch.tensor(ROLLOUT, dtype=F64), torch.tensor(MASK)


def test_levels() -> None:
    assert CORRECTION_LEVELS == ("token", "sequence")


def test_token_truncate() -> None:
    # Raw weights [0.5, 2, 3 | 1, 1.5, pad 0]; threshold = 2 (exactly the second token's weight, kept, not
    # counted): 3 -> 2. mean_weight = (0.5 + 2 + 2 + 1 + 1.5) / 5 = 1.4; truncated 1/5; max before 3.
    lp, rollout, mask = _inputs()
    weights, metrics = rollout_correction(lp, rollout, mask, threshold=TWO)
    assert _close(weights, [[0.5, 2.0, 2.0], [1.0, 1.5, 0.0]])
    assert float(metrics["mean_weight"]) == pytest.approx(1.4, abs=1e-12)
    assert float(metrics["truncated_fraction"]) == pytest.approx(1 / 5)
    assert float(metrics["weight_max"]) == pytest.approx(3.0, abs=1e-12)
    assert float(metrics["mismatch_kl"]) == pytest.approx(MISMATCH_KL, abs=1e-12)
    assert float(metrics["mismatch_kl"]) == pytest.approx(0.2991845, abs=1e-7)
    assert float(metrics["num_tokens"]) == 5
    assert "masked_fraction" not in metrics
    # A threshold just below 2 truncates the second token too.
    _, below = rollout_correction(lp, rollout, mask, threshold=TWO - 1e-12)
    assert float(below["truncated_fraction"]) == pytest.approx(2 / 5)


def test_token_mask_boundaries() -> None:
    # lower = 0.5 and threshold = 2 both equal a token's weight exactly: both kept; only 3 > 2 is masked.
    # weights [0.5, 2, 0 | 1, 1.5, 0]; mean (0.5 + 2 + 1 + 1.5) / 5 = 1.0; masked 1/5.
    lp, rollout, mask = _inputs()
    weights, metrics = rollout_correction(lp, rollout, mask, threshold=TWO, lower=HALF)
    assert _close(weights, [[0.5, 2.0, 0.0], [1.0, 1.5, 0.0]])
    assert float(metrics["mean_weight"]) == pytest.approx(1.0, abs=1e-12)
    assert float(metrics["masked_fraction"]) == pytest.approx(1 / 5)
    assert "truncated_fraction" not in metrics
    # lower just above 0.5 masks the first token as well: mean (2 + 1 + 1.5) / 5 = 0.9, masked 2/5.
    weights, metrics = rollout_correction(lp, rollout, mask, threshold=TWO, lower=HALF + 1e-12)
    assert weights[0].tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-12)
    assert float(metrics["mean_weight"]) == pytest.approx(0.9, abs=1e-12)
    assert float(metrics["masked_fraction"]) == pytest.approx(2 / 5)


def test_sequence_level_truncate_and_mask() -> None:
    # Row 0: sum d = ln(0.5 * 2 * 3) = ln 3 -> 3 on every token; row 1: sum d = ln 1.5 -> 1.5 on its 2 tokens.
    # Truncate at 2: [2, 2, 2 | 1.5, 1.5, 0], mean (6 + 3) / 5 = 1.8, truncated 3/5.
    # Mask [0.5, 2]: row 0 out -> [0, 0, 0 | 1.5, 1.5, 0], mean 3 / 5 = 0.6, masked 3/5.
    # mismatch_kl is the token-level k3 whatever the level.
    lp, rollout, mask = _inputs()
    weights, metrics = rollout_correction(lp, rollout, mask, level="sequence", threshold=2.0)
    assert _close(weights, [[2.0, 2.0, 2.0], [1.5, 1.5, 0.0]])
    assert float(metrics["mean_weight"]) == pytest.approx(1.8, abs=1e-12)
    assert float(metrics["truncated_fraction"]) == pytest.approx(3 / 5)
    assert float(metrics["weight_max"]) == pytest.approx(3.0, abs=1e-12)
    assert float(metrics["mismatch_kl"]) == pytest.approx(MISMATCH_KL, abs=1e-12)
    weights, metrics = rollout_correction(lp, rollout, mask, level="sequence", threshold=2.0, lower=0.5)
    assert _close(weights, [[0.0, 0.0, 0.0], [1.5, 1.5, 0.0]])
    assert float(metrics["mean_weight"]) == pytest.approx(0.6, abs=1e-12)
    assert float(metrics["masked_fraction"]) == pytest.approx(3 / 5)


def test_sequence_level_boundaries() -> None:
    # Row sums exactly ln 2 and ln 0.5 (the other tokens' d is 0): weights exactly 2 and 0.5, both on the
    # boundaries of [0.5, 2] and kept; a third row at ln 2.5 is above and masked (or truncated to 2).
    lp = torch.tensor([[LN(2.0), 0.0], [LN(0.5), 0.0], [LN(2.5), 0.0]], dtype=F64)
    rollout, mask = torch.zeros(3, 2, dtype=F64), torch.ones(3, 2)
    weights, metrics = rollout_correction(lp, rollout, mask, level="sequence", threshold=TWO, lower=HALF)
    assert _close(weights, [[2.0, 2.0], [0.5, 0.5], [0.0, 0.0]])
    assert float(metrics["masked_fraction"]) == pytest.approx(2 / 6)
    weights, metrics = rollout_correction(lp, rollout, mask, level="sequence", threshold=TWO)
    assert _close(weights, [[2.0, 2.0], [0.5, 0.5], [2.0, 2.0]])
    assert float(metrics["truncated_fraction"]) == pytest.approx(2 / 6)


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("lower", [None, 0.5])
def test_masked_nan_and_detached(level: str, lower: float | None) -> None:
    # The NaN at the masked position reaches neither weights nor metrics; a learner log-prob that carries
    # a gradient gives weights that do not.
    lp, rollout, mask = _inputs()
    weights, metrics = rollout_correction(lp.requires_grad_(), rollout, mask, level=level, lower=lower)
    assert torch.isfinite(weights).all() and weights[1, 2] == 0.0
    assert not weights.requires_grad
    assert all(torch.isfinite(v) and not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_all_masked_and_identical_policies() -> None:
    # No unmasked token: zero weights and zero metrics. Identical log-probs: weight 1, KL 0, nothing cut.
    nan = torch.full((2, 2), NAN, dtype=F64)
    weights, metrics = rollout_correction(nan, nan, torch.zeros(2, 2))
    assert weights.eq(0).all() and all(float(v) == 0.0 for v in metrics.values())
    lp = torch.tensor([[-0.3, -2.0]], dtype=F64)
    weights, metrics = rollout_correction(
        lp, lp.clone(), torch.ones(1, 2), level="sequence", lower=1.0, threshold=1.0
    )
    assert weights.tolist() == [[1.0, 1.0]]
    assert float(metrics["mismatch_kl"]) == 0.0 and float(metrics["masked_fraction"]) == 0.0


def test_diverged_log_ratio_is_finite() -> None:
    # d = 30 and -30 per token clamp to +-20 before exp: weights e^20 -> truncated to 2, and e^-20.
    lp = torch.tensor([[30.0, -30.0]])
    weights, metrics = rollout_correction(lp, torch.zeros(1, 2), torch.ones(1, 2))
    assert weights.dtype == torch.float32
    assert weights[0].tolist() == pytest.approx([2.0, math.exp(-20.0)], rel=1e-5)
    assert torch.isfinite(metrics["mismatch_kl"])


def test_weights_feed_policy_loss() -> None:
    # PPO at ratio 1 with token weights from the correction [0.5, 2 | 1, 1.5] and A = 1: gradient -w / 4.
    lp_learner = torch.tensor([[LN(0.5), LN(2.0)], [-1.0, -1.0 + LN(1.5)]], dtype=F64)
    rollout = torch.tensor([[0.0, 0.0], [-1.0, -1.0]], dtype=F64)
    weights, _ = rollout_correction(lp_learner, rollout, torch.ones(2, 2))
    lp = lp_learner.clone().requires_grad_()
    policy_loss(lp, lp_learner, torch.ones(2, dtype=F64), torch.ones(2, 2), weights=weights)[0].backward()
    assert _close(lp.grad, [[-0.125, -0.5], [-0.25, -0.375]])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"level": "row"}, r"unknown correction level 'row'.*'token', 'sequence'"),
        ({"threshold": 0.0}, "threshold must be > 0"),
        ({"lower": 3.0}, r"lower must be in \[0, threshold=2.0\]"),
        ({"lower": -0.1}, "lower must be in"),
    ],
)
def test_bad_inputs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"rollout_logprobs shape \(1, 3\) != logprobs shape \(1, 2\)"):
        rollout_correction(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        rollout_correction(torch.zeros(2), torch.zeros(2), torch.ones(2))


def test_mismatch_kl_is_never_negative_from_rounding() -> None:
    """k3 = e^d - d - 1 >= 0; in float32 with |d| ~ 1e-4 the subtraction rounded to -3e-10 and -8e-10 here."""
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = torch.randn(8, 64, generator=g) * 1e-4
        base = torch.randn(8, 64, generator=g) * 3
        _, m = rollout_correction(base + x, base, torch.ones_like(x))
        assert m["mismatch_kl"].item() >= 0.0
