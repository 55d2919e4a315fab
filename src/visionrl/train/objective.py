"""The training objective of one micro-batch, from its log-probs: what the learner back-propagates.

The policy loss of algorithm.loss (PPO, GSPO, CISPO or SAPO, `algo.policy_losses`) against the old log-probs,
with the rollout-correction weights (the learner's old log-probs over the engine's sampling ones), plus kl_coef
times the KL to the reference model and minus entropy_coef times the entropy; each aggregated by
algorithm.loss_aggregation with the normalisers of the whole mini-batch, so that the micro-batches' losses add
up to the mini-batch's. With its metrics: the loss terms, and per-token means that the learner weights by each
micro-batch's share of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visionrl import metrics as tags
from visionrl.algo import aggregate, kl_penalty, masked_mean, policy_loss, rollout_correction
from visionrl.config import AlgorithmConfig


@dataclass
class MicroBatchLoss:
    total: torch.Tensor  # the scalar to back-propagate
    terms: dict[str, torch.Tensor]  # detached: loss/policy, loss/kl (they add up over micro-batches)
    means: dict[
        str, torch.Tensor
    ]  # detached per-token means: clipping, approx. KL, entropy, mismatch, correction
    # detached [largest ratio, -smallest ratio] of the micro-batch's tokens (both reduce by max; -inf: no token)
    peaks: torch.Tensor


NO_PEAKS = torch.full((2,), float("-inf"))  # the ratio peaks of a micro-batch without tokens


def policy_can_move(algo: AlgorithmConfig) -> bool:
    """Whether the old policy can differ from the one trained: several updates per batch, or the engine's sampling
    log-probs as the old policy. Otherwise every ratio is 1 and `policy/approx_kl` is 0 by construction."""
    return algo.updates_per_batch > 1 or algo.old_logprobs == "engine"


def metric_keys(algo: AlgorithmConfig) -> list[str]:
    """What the learner sums over micro-batches and ranks: the loss terms, the per-token means, the count of
    micro-batches."""
    # loss/kl is written even without a KL term (0: DESIGN's required tags); approx_kl only where it can move
    keys = [tags.LOSS_POLICY, tags.LOSS_KL, tags.LOSS_TOTAL, tags.CLIP_FRACTION, tags.ENTROPY]
    if policy_can_move(algo):
        keys.append(tags.APPROX_KL)
    keys += [tags.CLIP_FRACTION_LOW, tags.CLIP_FRACTION_HIGH]
    keys += [tags.LOGPROB_DIFF, tags.LEARNER_MICRO_BATCHES, tags.LEARNER_FILLER_PASSES]
    if algo.rollout_correction != "off":
        keys += [tags.CORRECTION_WEIGHT, tags.CORRECTION_CLIPPED, tags.MISMATCH_KL]
    return keys


def micro_batch_loss(
    algo: AlgorithmConfig,
    lp: torch.Tensor,
    entropy: torch.Tensor,
    sampling_lp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norms: dict[str, float],
    old_lp: torch.Tensor | None = None,
    ref_lp: torch.Tensor | None = None,
) -> MicroBatchLoss:
    """The objective of a micro-batch from its log-probs `lp` and entropies [B, T] (with autograd), the engine's
    `sampling_lp`, the advantages [B] and the completion mask. `old_lp` None: the old policy is the engine's
    sampling log-probs (algorithm.old_logprobs=engine) or the detached `lp` (on-policy: ratio 1, the gradient of
    A * lp); `ref_lp` None: no KL term. `norms`: the mini-batch's normalisers (`aggregate`)."""
    if old_lp is None:
        old_lp = sampling_lp if algo.old_logprobs == "engine" else lp.detach()
    weights, correction = _correction(algo, old_lp, sampling_lp, mask)
    loss, pm = policy_loss(
        lp,
        old_lp,
        advantages,
        mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip=algo.dual_clip,
        aggregation=algo.loss_aggregation,
        kind=algo.loss,
        weights=weights,
        tau_pos=algo.tau_pos,
        tau_neg=algo.tau_neg,
        **norms,
    )
    total, kl = loss, torch.zeros((), device=lp.device)
    if ref_lp is not None:
        kl = aggregate(kl_penalty(lp, ref_lp, algo.kl_kind), mask, algo.loss_aggregation, **norms)
        total = total + algo.kl_coef * kl
    if algo.entropy_coef > 0:  # the entropy bonus; otherwise entropy is only reported
        total = total - algo.entropy_coef * aggregate(entropy, mask, algo.loss_aggregation, **norms)
    with torch.no_grad():
        means = {
            **correction,
            tags.CLIP_FRACTION: pm["clip_fraction"],
            tags.CLIP_FRACTION_LOW: pm["clip_fraction_low"],
            tags.CLIP_FRACTION_HIGH: pm["clip_fraction_high"],
            tags.ENTROPY: masked_mean(entropy.detach(), mask),
            tags.LOGPROB_DIFF: masked_mean((lp.detach() - sampling_lp).abs(), mask),
        }
        # on the device, no host sync: a micro-batch without tokens has no peaks
        peaks = torch.where(
            mask.any(), torch.stack([pm["ratio_max"], -pm["ratio_min"]]).float(), NO_PEAKS.to(lp.device)
        )
        if policy_can_move(algo):
            means[tags.APPROX_KL] = pm["approx_kl"]
    return MicroBatchLoss(total, {tags.LOSS_POLICY: loss.detach(), tags.LOSS_KL: kl.detach()}, means, peaks)


def _correction(
    algo: AlgorithmConfig, old_lp: torch.Tensor, sampling_lp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Rollout-correction weights (old log-probs over the engine's) for the policy loss, and their per-token
    metrics; (None, {}) with `algorithm.rollout_correction: off`."""
    if algo.rollout_correction == "off":
        return None, {}
    lower = algo.correction_lower if algo.correction_mode == "mask" else None
    weights, m = rollout_correction(
        old_lp,
        sampling_lp,
        mask,
        level=algo.rollout_correction,
        threshold=algo.correction_threshold,
        lower=lower,
    )
    affected = m["masked_fraction"] if lower is not None else m["truncated_fraction"]
    return weights, {
        tags.CORRECTION_WEIGHT: m["mean_weight"],
        tags.CORRECTION_CLIPPED: affected,
        tags.MISMATCH_KL: m["mismatch_kl"],
    }
