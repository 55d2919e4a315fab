"""The objective of one micro-batch (`train.objective`), on hand-made log-probs: the terms it adds up, the old
policy it falls back to, and the metrics it reports."""

from __future__ import annotations

import pytest
import torch

from visionrl import metrics as tags
from visionrl.config import AlgorithmConfig
from visionrl.train.objective import metric_keys, micro_batch_loss

# two sequences of 2 and 1 tokens (the third position is padding)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])
NORMS = {"num_tokens": 3.0, "num_sequences": 2.0, "norm_length": 3.0}


def _lp() -> torch.Tensor:
    return torch.tensor([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]], requires_grad=True)


def test_on_policy_the_loss_is_the_token_mean_of_minus_a_times_the_ratio_and_its_gradient_minus_a() -> None:
    algo = AlgorithmConfig(rollout_correction="off")
    lp, sampling = _lp(), torch.tensor([[-1.1, -0.5, 0.0], [-1.5, 0.0, 0.0]])
    out = micro_batch_loss(algo, lp, torch.zeros(2, 3), sampling, ADV, MASK, NORMS)
    # ratio 1 everywhere: loss = -(1 + 1 - 2) / 3 tokens = 0; d loss / d lp = -A / 3 at real tokens
    assert float(out.total.detach()) == pytest.approx(0.0)
    out.total.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]]))
    assert float(out.means[tags.CLIP_FRACTION]) == 0.0
    # |lp - engine| per token: (0.1 + 0 + 0.5) / 3
    assert float(out.means[tags.LOGPROB_DIFF]) == pytest.approx(0.2)
    assert set(out.terms) == {tags.LOSS_POLICY, tags.LOSS_KL} and float(out.terms[tags.LOSS_KL]) == 0.0
    assert (
        tags.APPROX_KL not in out.means
    )  # one update on-policy: every ratio is 1, approx_kl 0 by construction


def test_the_kl_and_entropy_terms_are_added_with_their_coefficients() -> None:
    algo = AlgorithmConfig(rollout_correction="off", kl_coef=0.5, kl_kind="k1", entropy_coef=0.1)
    lp, entropy = _lp(), torch.tensor([[0.3, 0.6, 9.0], [0.9, 9.0, 9.0]])
    ref = lp.detach() - 0.25  # k1 = lp - ref = 0.25 per token
    out = micro_batch_loss(algo, lp, entropy, lp.detach(), ADV, MASK, NORMS, ref_lp=ref)
    assert float(out.terms[tags.LOSS_KL]) == pytest.approx(0.25)
    assert float(out.means[tags.ENTROPY]) == pytest.approx(0.6)  # (0.3 + 0.6 + 0.9) / 3, padding out
    assert float(out.total.detach()) == pytest.approx(0.0 + 0.5 * 0.25 - 0.1 * 0.6)


def test_the_old_policy_is_the_engines_with_old_logprobs_engine_and_the_given_one_otherwise() -> None:
    engine = AlgorithmConfig(rollout_correction="off", old_logprobs="engine", clip_low=0.2, clip_high=0.2)
    lp = _lp()
    sampling = lp.detach() - 1.0  # the engine's log-probs far below: every ratio e^1 is clipped at 1.2
    out = micro_batch_loss(engine, lp, torch.zeros(2, 3), sampling, ADV, MASK, NORMS)
    assert float(out.means[tags.CLIP_FRACTION]) > 0
    learner = AlgorithmConfig(rollout_correction="off")
    given = micro_batch_loss(learner, _lp(), torch.zeros(2, 3), sampling, ADV, MASK, NORMS, old_lp=sampling)
    assert float(given.terms[tags.LOSS_POLICY]) == pytest.approx(float(out.terms[tags.LOSS_POLICY]))


def test_metric_keys_cover_what_a_micro_batch_reports() -> None:
    for correction in ("off", "token"):
        algo = AlgorithmConfig(rollout_correction=correction)
        lp = _lp()
        out = micro_batch_loss(algo, lp, torch.zeros(2, 3), lp.detach(), ADV, MASK, NORMS)
        keys = metric_keys(algo)
        assert {*out.terms, *out.means, tags.LOSS_TOTAL} <= set(keys)
        assert (tags.CORRECTION_WEIGHT in keys) is (correction != "off")
    # approx_kl exists exactly when it can be other than zero; loss/kl always (a required tag)
    for algo, kl, approx in [
        (AlgorithmConfig(), False, False),
        (AlgorithmConfig(kl_coef=0.1), True, False),
        (AlgorithmConfig(updates_per_batch=2), False, True),
        (AlgorithmConfig(old_logprobs="engine", rollout_correction="off"), False, True),
    ]:
        keys = metric_keys(algo)
        assert (tags.LOSS_KL in keys, tags.APPROX_KL in keys) == (True, approx)
        lp = _lp()
        ref = lp.detach() if kl else None
        out = micro_batch_loss(algo, lp, torch.zeros(2, 3), lp.detach(), ADV, MASK, NORMS, ref_lp=ref)
        assert {*out.terms, *out.means, tags.LOSS_TOTAL} <= set(keys)
