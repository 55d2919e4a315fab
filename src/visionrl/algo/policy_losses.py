"""Policy-gradient surrogate losses for GRPO-style training: the ratio-based variants, pure tensor math.

Shapes: B sequences (completions) by T padded response tokens; ``mask`` [B, T] is nonzero on real
response tokens. Values under the mask's zeros never reach a loss, a metric or a gradient, even if NaN.

Each variant is a per-token function looked up by name in ``_KINDS`` (names in ``LOSS_KINDS``):

- ``ppo``: the clipped surrogate on the per-token ratio (with DAPO's clip-higher and an optional dual clip).
- ``gspo``: one ratio per sequence (the geometric mean of its token ratios), clipped like PPO. Token-level
  ratios are noisy on long completions and under MoE routing changes; a sequence-level ratio is not.
- ``cispo``: the clipped importance weight is a constant coefficient of ``-A * logprob``, so tokens whose
  ratio leaves the trust region still get a (bounded) gradient instead of none.
- ``sapo``: a smooth sigmoid gate of the ratio replaces the hard clip: the gradient fades gradually as
  the ratio moves away from 1 instead of dropping to zero at a boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from visionrl.algo.aggregation import AGGREGATIONS, aggregate, masked_mean

__all__ = ["LOSS_KINDS", "MAX_LOG_RATIO", "policy_loss"]

#: Log-ratios are clamped here before exp: the ratio stays within [2e-9, 4.9e8], so a token whose policy
#: has diverged gives a huge but finite loss and a zero (not inf * 0 = NaN) gradient.
MAX_LOG_RATIO = 20.0
# GSPO's sequence log-ratio is a mean over tokens, so it moves far less than a token's; capping it at 10
# (ratio 2.2e4) bounds a diverged sequence's loss and zeroes its gradient, well before float32 overflow.
_GSPO_MAX_LOG_RATIO = 10.0


@dataclass(frozen=True)
class _Inputs:
    """One call's tensors in the compute dtype, padding replaced by 0 so that it has zero gradient."""

    keep: Tensor  # bool [B, T]
    adv: Tensor  # [B, T], detached
    logprobs: Tensor  # [B, T], carries the gradient
    log_ratio: Tensor  # [B, T], logprobs - old_logprobs, not clamped, carries the gradient


@dataclass(frozen=True)
class _Settings:
    clip_low: float | None  # None: no lower bound (CISPO as MiniMax-M1 defines it)
    clip_high: float
    dual_clip: float | None
    tau_pos: float
    tau_neg: float


@dataclass(frozen=True)
class _TokenLoss:
    """A kind's per-token loss, the ratio it reports, and where its clip bound (low / high side)."""

    per_token: Tensor
    ratio: Tensor
    clipped_low: Tensor
    clipped_high: Tensor
    extra: dict[str, Tensor] = field(default_factory=dict)


KindFn = Callable[[_Inputs, _Settings], _TokenLoss]


def _clipped_surrogate(adv: Tensor, ratio: Tensor, s: _Settings) -> tuple[Tensor, Tensor]:
    """``max(-A r, -A clip(r))`` per token, and the bool mask where the clipped term is strictly larger."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(_lower(s), 1.0 + s.clip_high)
    # where() on the strict comparison rather than torch.maximum: at the boundary (a tie) the token keeps
    # the unclipped gradient, and the rule is the one clip_fraction counts.
    is_clipped = clipped > unclipped
    return torch.where(is_clipped, clipped, unclipped), is_clipped


def _lower(s: _Settings) -> float | None:
    """The ratio's lower clip bound, 1 - clip_low; None where there is none."""
    return None if s.clip_low is None else 1.0 - s.clip_low


def _ppo(x: _Inputs, s: _Settings) -> _TokenLoss:
    """PPO: the clipped surrogate on r = exp(lp - old); ``dual_clip`` caps the loss of A < 0 tokens."""
    ratio = x.log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    per_token, is_clipped = _clipped_surrogate(x.adv, ratio, s)
    extra: dict[str, Tensor] = {}
    if s.dual_clip is not None:
        cap = -x.adv * s.dual_clip
        dual_bound = (x.adv < 0) & (per_token > cap)
        per_token = torch.where(dual_bound, cap, per_token)
        extra["dual_clip_fraction"] = masked_mean(dual_bound.to(ratio.dtype), x.keep)
    return _TokenLoss(per_token, ratio, is_clipped & (x.adv < 0), is_clipped & (x.adv > 0), extra)


def _gspo(x: _Inputs, s: _Settings) -> _TokenLoss:
    """GSPO: every token of row i carries the sequence ratio exp(mean_t(lp - old)), clipped like PPO.

    Its value is the sequence ratio, its gradient flows through the token's own log-prob only
    (lp - sg(lp) + sg(m_i)); with ``seq_mean_token_mean`` this is the gradient of the sequence objective.
    """
    count = x.keep.sum(dim=1, keepdim=True).clamp(min=1).to(x.log_ratio.dtype)
    seq_log_ratio = (x.log_ratio.sum(dim=1, keepdim=True) / count).detach()
    log_ratio = (x.logprobs - x.logprobs.detach() + seq_log_ratio).clamp(max=_GSPO_MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    per_token, is_clipped = _clipped_surrogate(x.adv, ratio, s)
    return _TokenLoss(per_token, ratio, is_clipped & (x.adv < 0), is_clipped & (x.adv > 0))


def _cispo(x: _Inputs, s: _Settings) -> _TokenLoss:
    """CISPO: ``-sg(clip(r)) * A * lp``; the gradient -clip(r) * A survives where r is clipped."""
    ratio = x.log_ratio.detach().clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    low, high = _lower(s), 1.0 + s.clip_high
    weight = ratio.clamp(low, high)
    below = torch.zeros_like(x.keep) if low is None else ratio < low
    return _TokenLoss(-weight * x.adv * x.logprobs, ratio, below, ratio > high)


def _sapo(x: _Inputs, s: _Settings) -> _TokenLoss:
    """SAPO: ``-A * (4 / tau) * sigmoid(tau * (r - 1))``, tau = tau_pos where A > 0, tau_neg otherwise.

    d/dlp = -A * 4 g (1 - g) * r with g the sigmoid: exactly PPO's -A at r = 1, fading smoothly with
    |r - 1|; ``gate_mean`` reports the masked mean of that factor 4 g (1 - g) (1 = fully on-policy).
    """
    ratio = x.log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    tau = torch.where(x.adv > 0, torch.full_like(x.adv, s.tau_pos), torch.full_like(x.adv, s.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    g = gate.detach()
    never = torch.zeros_like(x.keep)
    extra = {"gate_mean": masked_mean(4.0 * g * (1.0 - g), x.keep)}
    return _TokenLoss(-x.adv * (4.0 / tau) * gate, ratio, never, never, extra)


_KINDS: dict[str, KindFn] = {"ppo": _ppo, "gspo": _gspo, "cispo": _cispo, "sapo": _sapo}
# Dual clip bounds PPO's one unbounded side (A < 0, r large). CISPO and SAPO bound their weight already,
# and GSPO's sequence ratio is capped at exp(10); silently ignoring dual_clip there would hide a misconfig.
_DUAL_CLIP_KINDS = frozenset({"ppo"})

#: Names accepted by ``policy_loss(kind=...)``; configs can validate against this.
LOSS_KINDS: tuple[str, ...] = tuple(_KINDS)


def _kind_fn(kind: str, aggregation: str) -> KindFn:
    """The per-token function of `kind`; ValueError for an unknown kind or aggregation."""
    try:
        kind_fn = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown policy loss kind {kind!r}; choose one of {list(_KINDS)}") from None
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {list(AGGREGATIONS)}")
    return kind_fn


def _check_policy_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weights: Tensor | None,
    s: _Settings,
    kind: str,
) -> None:
    """Raise ValueError naming the bad argument, its value and what is expected."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    others = [("old_logprobs", old_logprobs), ("mask", mask)]
    for name, other in others + ([("weights", weights)] if weights is not None else []):
        if other.shape != logprobs.shape:
            raise ValueError(
                f"{name} shape {tuple(other.shape)} != logprobs shape {tuple(logprobs.shape)}; both must be "
                "[B, T] over the same response tokens"
            )
    b, t = logprobs.shape
    if tuple(advantages.shape) not in ((b,), (b, t)):
        raise ValueError(
            f"advantages must be [B]={b} (one per sequence) or [B, T]=({b}, {t}) (per token), "
            f"got shape {tuple(advantages.shape)}"
        )
    if s.clip_low is None and kind != "cispo":
        raise ValueError(f"clip_low=None (no lower bound) is for kind='cispo' only, got kind={kind!r}")
    if s.clip_low is not None and not 0 <= s.clip_low < 1:
        raise ValueError(
            f"clip_low must be in [0, 1) so that 1 - clip_low stays positive, got {s.clip_low!r}"
        )
    if not s.clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {s.clip_high!r}")
    if s.dual_clip is not None and not s.dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (3.0 is usual) or None to disable, got {s.dual_clip!r}")
    for name, tau in (("tau_pos", s.tau_pos), ("tau_neg", s.tau_neg)):
        if not tau > 0:
            raise ValueError(f"{name} must be > 0 (the sharpness of SAPO's gate), got {tau!r}")
    if s.dual_clip is not None and kind not in _DUAL_CLIP_KINDS:
        raise ValueError(
            f"dual_clip applies only to kind in {sorted(_DUAL_CLIP_KINDS)}, got kind={kind!r} with "
            f"dual_clip={s.dual_clip!r}; set dual_clip=None"
        )


def _inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[_Inputs, Tensor]:
    """The kinds' inputs in the compute dtype, and the raw log-ratio lp - old (for the metrics)."""
    # Ratios of bf16 log-probs are too coarse; float64 inputs stay float64.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask != 0
    adv = advantages.detach().to(dtype)
    adv = adv[:, None].expand(logprobs.shape) if adv.dim() == 1 else adv
    lp = logprobs.to(dtype)
    raw_log_ratio = lp - old_logprobs.detach().to(dtype)
    # Padding may hold garbage log-probs; where() gives its unselected branch exactly zero gradient.
    inputs = _Inputs(keep, adv, torch.where(keep, lp, 0.0), torch.where(keep, raw_log_ratio, 0.0))
    return inputs, raw_log_ratio


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    kind: str = "ppo",
    weights: Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient surrogate loss of the chosen ``kind``, aggregated over unmasked tokens.

    Per token, with A the advantage, lp / old the log-probs, sg the stop-gradient and
    r = exp(clamp(lp - old, -20, 20)):

    - ``ppo``: ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip=c`` (c > 1) the
      loss of tokens with A < 0 is also capped at ``-A c``. ``clip_high > clip_low`` is DAPO's clip-higher.
    - ``gspo``: the same clipped surrogate with r replaced by the row's sequence ratio
      s = exp(min(m_i, 10)), m_i = sum_t mask (lp - old) / max(1, sum_t mask); its gradient flows through
      each token's own lp. No dual clip.
    - ``cispo``: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) A lp``; ``clip_low=None`` leaves r unbounded
      below (MiniMax-M1's CISPO: a token the policy now finds far less likely keeps a small weight, not 1 -
      clip_low). No dual clip.
    - ``sapo``: ``-A (4 / tau) sigmoid(tau (r - 1))`` with tau = ``tau_pos`` where A > 0, else
      ``tau_neg``; clip_low / clip_high are unused. No dual clip.

    Args:
        logprobs: [B, T] log-probs under the policy being trained (carries the gradient).
        old_logprobs: [B, T] log-probs under the policy that sampled; treated as constants (detached).
        advantages: [B] (broadcast over tokens) or [B, T]; treated as constants (detached).
        mask: [B, T], nonzero on real response tokens.
        kind: a name from ``LOSS_KINDS``.
        weights: optional [B, T] per-token factors (e.g. ``rollout_correction``'s), detached, multiplying
            the per-token losses before aggregation.
        aggregation, num_tokens, num_sequences, norm_length: see ``aggregate``.

    Returns:
        (loss, metrics). Metrics are detached 0-d tensors over this call's unmasked tokens:
        ``clip_fraction`` (tokens where the clip binds: for ppo/gspo the clipped term strictly larger,
        for cispo the clip changed r, for sapo always 0), ``clip_fraction_low`` / ``clip_fraction_high``
        (its A < 0 / A > 0 sides; for cispo r below / above the range), ``approx_kl`` (mean of
        old - lp), ``ratio_mean``, ``ratio_max``, ``ratio_min`` (of the kind's ratio: s for gspo),
        ``num_tokens``; with ``dual_clip`` ``dual_clip_fraction``; for sapo ``gate_mean``. Empty batches
        give 0 for each.
    """
    kind_fn = _kind_fn(kind, aggregation)
    settings = _Settings(clip_low, clip_high, dual_clip, tau_pos, tau_neg)
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, weights, settings, kind)
    inputs, raw_log_ratio = _inputs(logprobs, old_logprobs, advantages, mask)
    keep = inputs.keep
    out = kind_fn(inputs, settings)
    per_token = out.per_token
    if weights is not None:
        # Zero the weights' padding first: NaN * 0 there would still poison the product's gradient.
        per_token = per_token * torch.where(keep, weights.detach().to(per_token.dtype), 0.0)
    norms = {"num_tokens": num_tokens, "num_sequences": num_sequences, "norm_length": norm_length}
    loss = aggregate(per_token, keep, aggregation, **norms)
    return loss, _policy_metrics(keep, out, raw_log_ratio)


@torch.no_grad()
def _policy_metrics(keep: Tensor, out: _TokenLoss, raw_log_ratio: Tensor) -> dict[str, Tensor]:
    """Detached 0-d diagnostics of one ``policy_loss`` call (see its docstring for the keys)."""
    ratio = out.ratio.detach()
    dtype = ratio.dtype
    zero = torch.zeros((), dtype=dtype, device=ratio.device)
    if ratio.numel() == 0:
        ratio_max, ratio_min = zero, zero
    else:
        # Ratios are > 0, so 0 / +inf fill values never win; an all-masked batch reports 0.
        ratio_max = torch.where(keep, ratio, 0.0).amax()
        ratio_min = torch.where(keep.any(), torch.where(keep, ratio, float("inf")).amin(), zero)
    metrics = {
        "clip_fraction": masked_mean((out.clipped_low | out.clipped_high).to(dtype), keep),
        "clip_fraction_low": masked_mean(out.clipped_low.to(dtype), keep),
        "clip_fraction_high": masked_mean(out.clipped_high.to(dtype), keep),
        "approx_kl": masked_mean(-raw_log_ratio.detach(), keep),
        "ratio_mean": masked_mean(ratio, keep),
        "ratio_max": ratio_max,
        "ratio_min": ratio_min,
        "num_tokens": keep.sum().to(dtype),
    }
    metrics.update({name: value.detach() for name, value in out.extra.items()})
    return metrics
