"""Importance weights that correct for the gap between the sampling engine and the learner.

The engine that generated a rollout (e.g. vLLM, bf16 kernels, another batch layout) and the learner that
recomputes its log-probs are not numerically the same policy, so the rollout is slightly off-policy even
at the first optimiser step. ``rollout_correction`` turns the per-token log-prob gap into detached
weights for ``policy_loss(weights=...)``, bounded so that a few tokens with a large gap cannot dominate.

Levels (``CORRECTION_LEVELS``, looked up in ``_LEVELS``): ``token`` weighs each token by its own ratio,
``sequence`` gives every token of a row the row's product of ratios. Modes (in ``_MODES``): with
``lower=None`` weights above ``threshold`` are truncated to it (truncated importance sampling); with a
``lower`` bound, tokens whose weight falls outside ``[lower, threshold]`` are masked out (weight 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from visionrl.algo.aggregation import masked_mean
from visionrl.algo.policy_losses import MAX_LOG_RATIO

__all__ = ["CORRECTION_LEVELS", "rollout_correction"]

# (log-ratio learner - engine [B, T], padding 0; bool mask [B, T]) -> unbounded weights [B, T]
LevelFn = Callable[[Tensor, Tensor], Tensor]
# (weights [B, T] with padding 0, bool mask, lower, threshold) -> (bounded weights, bool "affected" mask)
ModeFn = Callable[[Tensor, Tensor, float, float], tuple[Tensor, Tensor]]


def _token_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _sequence_level(log_ratio: Tensor, keep: Tensor) -> Tensor:
    # The sequence's likelihood ratio is the product of its token ratios: a sum in log space.
    seq = log_ratio.sum(dim=1, keepdim=True).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    return seq.expand(log_ratio.shape)


def _truncate(weights: Tensor, keep: Tensor, lower: float, threshold: float) -> tuple[Tensor, Tensor]:
    affected = keep & (weights > threshold)
    return weights.clamp(max=threshold), affected


def _mask(weights: Tensor, keep: Tensor, lower: float, threshold: float) -> tuple[Tensor, Tensor]:
    affected = keep & ((weights < lower) | (weights > threshold))
    return torch.where(affected, 0.0, weights), affected


_LEVELS: dict[str, LevelFn] = {"token": _token_level, "sequence": _sequence_level}
_MODES: dict[str, ModeFn] = {"truncated": _truncate, "masked": _mask}

#: Names accepted by ``rollout_correction(level=...)``; configs can validate against this.
CORRECTION_LEVELS: tuple[str, ...] = tuple(_LEVELS)


def _check_inputs(
    logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, threshold: float, lower: float | None
) -> None:
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, other in (("rollout_logprobs", rollout_logprobs), ("mask", mask)):
        if other.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(other.shape)} != logprobs shape {tuple(logprobs.shape)}; both must be "
                "[B, T] over the same response tokens"
            )
    if not threshold > 0:
        raise ValueError(f"threshold must be > 0 (the largest weight kept; 2.0 is usual), got {threshold!r}")
    if lower is not None and not 0 <= lower <= threshold:
        raise ValueError(f"lower must be in [0, threshold={threshold!r}] or None to truncate, got {lower!r}")


@torch.no_grad()
def rollout_correction(
    logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    threshold: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Detached per-token importance weights learner / engine, bounded, and mismatch diagnostics.

    With d = logprobs - rollout_logprobs on unmasked tokens: ``level="token"`` gives w = exp(d) per
    token; ``level="sequence"`` gives every token of row i exp(sum_t mask d) (log-ratios clamped to
    [-20, 20] before exp). Padding gets 0. Then ``lower=None``: w = min(w, threshold); otherwise tokens
    whose w lies outside [lower, threshold] (boundaries kept) get 0.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the learner (any gradient is ignored).
        rollout_logprobs: [B, T] log-probs the sampling engine reported for the same tokens.
        mask: [B, T], nonzero on real response tokens.
        level: a name from ``CORRECTION_LEVELS``.
        threshold: the largest weight kept, > 0.
        lower: None to truncate at ``threshold``, or the smallest weight kept, in [0, threshold].

    Returns:
        (weights [B, T] in float32 or float64, metrics). Metrics are detached 0-d tensors over the
        unmasked tokens: ``mean_weight`` (after bounding), ``weight_max`` (before bounding),
        ``truncated_fraction`` (lower=None) or ``masked_fraction`` (share of tokens whose weight
        was changed), ``mismatch_kl`` and ``num_tokens``. ``mismatch_kl`` is the masked mean of the
        k3 estimator exp(d) - d - 1 of KL(engine || learner): the tokens were sampled by the engine, so
        with rho = learner / engine = exp(d), E_engine[rho - 1 - log rho] = KL(engine || learner), and
        each term is >= 0. Values under the mask's zeros (even NaN) reach neither weights nor metrics.
    """
    try:
        level_fn = _LEVELS[level]
    except KeyError:
        raise ValueError(f"unknown correction level {level!r}; choose one of {list(_LEVELS)}") from None
    _check_inputs(logprobs, rollout_logprobs, mask, threshold, lower)
    mode = "truncated" if lower is None else "masked"
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask != 0
    log_ratio = torch.where(keep, logprobs.detach().to(dtype) - rollout_logprobs.detach().to(dtype), 0.0)
    raw = torch.where(keep, level_fn(log_ratio, keep), 0.0)
    weights, affected = _MODES[mode](raw, keep, 0.0 if lower is None else lower, threshold)
    clamped = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = (clamped.exp() - clamped - 1.0).clamp_min(0.0)  # >= 0 exactly; rounding alone made it -1e-9
    metrics = {
        "mean_weight": masked_mean(weights, keep),
        "weight_max": raw.amax() if raw.numel() else torch.zeros((), dtype=dtype, device=raw.device),
        f"{mode}_fraction": masked_mean(affected.to(dtype), keep),
        "mismatch_kl": masked_mean(k3, keep),
        "num_tokens": keep.sum().to(dtype),
    }
    return weights, metrics
