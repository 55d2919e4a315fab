"""Per-token losses of GRPO-style policy optimisation: pure tensor math, no I/O.

Shapes: B sequences (completions) by T padded response tokens. ``mask`` is [B, T], nonzero on real
response tokens and zero on padding; values under the mask's zeros never reach a loss, a metric or a
gradient, even if they are NaN.

Aggregations (how per-token values become one scalar) are looked up by name in ``_AGGREGATIONS``, KL
estimators in ``_KL_KINDS``. The policy loss, the KL term and the entropy term can all go through
``aggregate`` so that they are weighted the same way.

Gradient accumulation: a learner that splits a batch into micro-batches passes the GLOBAL normalisers
(``num_tokens`` for ``token_mean``, ``num_sequences`` for the ``seq_mean_*`` family, ``norm_length`` for
``seq_mean_token_sum_norm``), and then the sum of the micro-batch losses equals the full-batch loss, and so
do the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "aggregate",
    "entropy_from_logits",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
]

# Log-ratios are clamped here before exp: the ratio stays within [2e-9, 4.9e8], so a token whose policy
# has diverged gives a huge but finite loss and a zero (not inf * 0 = NaN) gradient.
_MAX_LOG_RATIO = 20.0
# k3 is clamped to [-10, 10]; its argument reaches that clamp well inside +-20 (k3(2.7) > 10 and
# k3(-11.1) > 10), so pre-clamping at +-20 changes no value but keeps exp() from overflowing.
_K3_CLAMP = 10.0


def _safe_div(total: Tensor, count: Tensor | float) -> Tensor:
    """``total / count``, and 0 (with zero gradient, never NaN) where ``count`` is 0."""
    if not isinstance(count, Tensor):
        return total / count if count > 0 else total * 0.0
    positive = count > 0
    return torch.where(positive, total / torch.where(positive, count, torch.ones_like(count)), 0.0)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero, over ``dim`` (all dims when None).

    ``mask`` must have the shape of ``x``. Slices without any unmasked element give 0, not NaN.
    """
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != x shape {tuple(x.shape)}; they must match")
    keep = mask != 0
    # where(), not x * mask: padding may hold NaN/inf, and NaN * 0 is NaN.
    total = torch.where(keep, x, 0.0).sum() if dim is None else torch.where(keep, x, 0.0).sum(dim)
    count = keep.sum().to(total.dtype) if dim is None else keep.sum(dim).to(total.dtype)
    return _safe_div(total, count)


@dataclass(frozen=True)
class _Normalisers:
    """Divisors for one aggregation call; None means "count locally"."""

    num_tokens: float | None
    num_sequences: float | None
    norm_length: float


# (per-token values with padding zeroed [B, T], bool mask [B, T], normalisers) -> scalar
AggregationFn = Callable[[Tensor, Tensor, _Normalisers], Tensor]


def _token_mean(values: Tensor, keep: Tensor, norm: _Normalisers) -> Tensor:
    count = norm.num_tokens if norm.num_tokens is not None else keep.sum().to(values.dtype)
    return _safe_div(values.sum(), count)


def _mean_over_sequences(per_seq: Tensor, keep: Tensor, norm: _Normalisers) -> Tensor:
    # A fully masked row (e.g. a rejected completion) is not a sequence to average over.
    if norm.num_sequences is not None:
        return _safe_div(per_seq.sum(), norm.num_sequences)
    return _safe_div(per_seq.sum(), keep.any(dim=1).sum().to(per_seq.dtype))


def _seq_mean_token_mean(values: Tensor, keep: Tensor, norm: _Normalisers) -> Tensor:
    per_seq = _safe_div(values.sum(dim=1), keep.sum(dim=1).to(values.dtype))
    return _mean_over_sequences(per_seq, keep, norm)


def _seq_mean_token_sum(values: Tensor, keep: Tensor, norm: _Normalisers) -> Tensor:
    return _mean_over_sequences(values.sum(dim=1), keep, norm)


def _seq_mean_token_sum_norm(values: Tensor, keep: Tensor, norm: _Normalisers) -> Tensor:
    # Dr. GRPO: a constant divisor, so long and short completions weigh their tokens alike.
    return _mean_over_sequences(_safe_div(values.sum(dim=1), norm.norm_length), keep, norm)


_AGGREGATIONS: dict[str, AggregationFn] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}

#: Names accepted by ``aggregate`` / ``policy_loss(aggregation=...)``.
AGGREGATIONS: tuple[str, ...] = tuple(_AGGREGATIONS)


def _check_normaliser(name: str, value: float | None) -> None:
    if value is not None and not value >= 0:
        raise ValueError(f"{name} must be >= 0 (a count over the whole batch) or None, got {value!r}")


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    aggregation: str = "token_mean",
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar over the unmasked tokens.

    Args:
        per_token: [B, T] values (loss, KL, entropy...).
        mask: [B, T], nonzero on real tokens.
        aggregation: a name from ``AGGREGATIONS``:
            ``token_mean``: sum over unmasked tokens / number of unmasked tokens.
            ``seq_mean_token_mean``: mean over each sequence's tokens, then mean over sequences.
            ``seq_mean_token_sum``: sum over each sequence's tokens, then mean over sequences.
            ``seq_mean_token_sum_norm``: each sequence's token sum / ``norm_length``, then mean over
            sequences (Dr. GRPO).
            "Mean over sequences" counts only sequences with at least one unmasked token.
        num_tokens: ``token_mean`` only: divide by this global token count instead of the local one.
        num_sequences: ``seq_mean_*`` only: divide by this global count of non-empty sequences.
        norm_length: ``seq_mean_token_sum_norm`` only: the divisor, by default T = ``mask.shape[1]``.
            Pass a fixed value (e.g. the generation budget) when micro-batches are padded to different T.

    Each aggregation uses only the normaliser that applies to it. A zero normaliser, or no unmasked
    token at all, gives 0 with zero gradient, never NaN.
    """
    try:
        fn = _AGGREGATIONS[aggregation]
    except KeyError:
        raise ValueError(
            f"unknown aggregation {aggregation!r}; choose one of {list(_AGGREGATIONS)}"
        ) from None
    if per_token.dim() != 2 or mask.shape != per_token.shape:
        raise ValueError(
            f"per_token and mask must both be [B, T]; got {tuple(per_token.shape)} and {tuple(mask.shape)}"
        )
    _check_normaliser("num_tokens", num_tokens)
    _check_normaliser("num_sequences", num_sequences)
    _check_normaliser("norm_length", norm_length)
    keep = mask != 0
    norm = _Normalisers(
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=float(mask.shape[1]) if norm_length is None else norm_length,
    )
    return fn(torch.where(keep, per_token, 0.0), keep, norm)


def _check_policy_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
) -> None:
    """Raise ValueError naming the bad argument, its value and what is expected."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, other in (("old_logprobs", old_logprobs), ("mask", mask)):
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
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1) so that 1 - clip_low stays positive, got {clip_low!r}")
    if not clip_high >= 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    norm_length: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss, aggregated over unmasked tokens.

    Per token, with r = exp(logprobs - old_logprobs):
    ``loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``; with ``dual_clip=c`` (c > 1) the
    loss of tokens with A < 0 is also capped at ``-A * c``, bounding the push-down on tokens whose ratio
    has exploded. ``clip_high > clip_low`` is DAPO's clip-higher.

    Args:
        logprobs: [B, T] log-probs under the policy being trained (carries the gradient).
        old_logprobs: [B, T] log-probs under the policy that sampled; treated as constants (detached).
        advantages: [B] (broadcast over tokens) or [B, T]; treated as constants (detached).
        mask: [B, T], nonzero on real response tokens.
        aggregation, num_tokens, num_sequences, norm_length: see ``aggregate``.

    Returns:
        (loss, metrics). Metrics are detached 0-d tensors over this call's unmasked tokens:
        ``clip_fraction`` (tokens where the clipped term binds, strictly), ``clip_fraction_low``
        (A < 0 side), ``clip_fraction_high`` (A > 0 side), ``approx_kl`` (mean of old - new log-prob),
        ``ratio_mean``, ``ratio_max``, ``ratio_min``, ``num_tokens`` and, with ``dual_clip``,
        ``dual_clip_fraction``. Empty batches give 0 for each.
    """
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; choose one of {list(_AGGREGATIONS)}")
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1 (3.0 is usual) or None to disable, got {dual_clip!r}")
    # Ratios of bf16 log-probs are too coarse; float64 inputs stay float64.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    keep = mask != 0
    adv = advantages.detach().to(dtype)
    adv = adv[:, None].expand(logprobs.shape) if adv.dim() == 1 else adv
    raw_log_ratio = logprobs.to(dtype) - old_logprobs.detach().to(dtype)
    # Padding may hold garbage log-probs; where() gives its unselected branch exactly zero gradient.
    log_ratio = torch.where(keep, raw_log_ratio, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # where() on the strict comparison rather than torch.maximum: at the boundary (a tie) the token keeps
    # the unclipped gradient, and the rule is the one clip_fraction counts.
    is_clipped = clipped > unclipped
    per_token = torch.where(is_clipped, clipped, unclipped)
    dual_bound: Tensor | None = None
    if dual_clip is not None:
        cap = -adv * dual_clip
        dual_bound = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_bound, cap, per_token)
    loss = aggregate(
        per_token,
        keep,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    metrics = _policy_metrics(keep, adv, ratio, raw_log_ratio, is_clipped, dual_bound)
    return loss, metrics


@torch.no_grad()
def _policy_metrics(
    keep: Tensor,
    adv: Tensor,
    ratio: Tensor,
    raw_log_ratio: Tensor,
    is_clipped: Tensor,
    dual_bound: Tensor | None,
) -> dict[str, Tensor]:
    """Detached 0-d diagnostics of one ``policy_loss`` call (see its docstring for the keys)."""
    dtype = ratio.dtype
    zero = torch.zeros((), dtype=dtype, device=ratio.device)
    any_token = keep.any()
    if ratio.numel() == 0:
        ratio_max, ratio_min = zero, zero
    else:
        # Ratios are > 0, so 0 / +inf fill values never win; an all-masked batch reports 0.
        ratio_max = torch.where(keep, ratio, 0.0).amax()
        ratio_min = torch.where(any_token, torch.where(keep, ratio, float("inf")).amin(), zero)
    metrics = {
        "clip_fraction": masked_mean(is_clipped.to(dtype), keep),
        "clip_fraction_low": masked_mean((is_clipped & (adv < 0)).to(dtype), keep),
        "clip_fraction_high": masked_mean((is_clipped & (adv > 0)).to(dtype), keep),
        "approx_kl": masked_mean(-raw_log_ratio.detach(), keep),
        "ratio_mean": masked_mean(ratio.detach(), keep),
        "ratio_max": ratio_max.detach(),
        "ratio_min": ratio_min.detach(),
        "num_tokens": keep.sum().to(dtype),
    }
    if dual_bound is not None:
        metrics["dual_clip_fraction"] = masked_mean(dual_bound.to(dtype), keep)
    return metrics


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: Tensor) -> Tensor:
    # Schulman's unbiased, always >= 0 estimator of KL(policy || ref), with d = ref - lp = -log_ratio.
    d = (-log_ratio).clamp(-2 * _K3_CLAMP, 2 * _K3_CLAMP)
    return (d.exp() - d - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


_KL_KINDS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}

#: Names accepted by ``kl_penalty(kind=...)``.
KL_KINDS: tuple[str, ...] = tuple(_KL_KINDS)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    ``k1 = lp - ref``; ``k2 = 0.5 (lp - ref)^2``; ``k3 = exp(ref - lp) - (ref - lp) - 1`` clamped to
    [-10, 10]. Same shape as the inputs; aggregate it with ``aggregate``.
    """
    try:
        fn = _KL_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown KL kind {kind!r}; choose one of {list(_KL_KINDS)}") from None
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    return fn(logprobs - ref_logprobs)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...], float32 (or float64) math.

    Uses H = logsumexp(z) - sum(softmax(z) * z), which stays finite with a finite gradient even where
    probabilities underflow to 0 (p * log p would need log 0). Logits must be finite; suppress tokens
    with a large negative value, not -inf.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(z, dim=-1)
    # A batched dot product: avoids materialising the [..., V] product probs * z.
    expected_logit = torch.einsum("...v,...v->...", probs, z)
    return torch.logsumexp(z, dim=-1) - expected_logit


def token_logprobs(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-softmax of ``logits`` gathered at ``token_ids``: [B, T, V], [B, T] -> [B, T] (any leading dims).

    Computed as ``logit[token] - logsumexp(logits)`` in float32 (float64 stays float64): log_softmax
    would return a second full [..., V] tensor and keep it alive until backward, whereas logsumexp only
    needs a transient temporary, returns [...] and its backward reuses the logits. bf16 logits are
    upcast once (needed for precision). Token ids must lie in [0, V).
    """
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
    if logits.dim() != token_ids.dim() + 1 or logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits must be token_ids' shape plus a vocab dim: got logits {tuple(logits.shape)}, "
            f"token_ids {tuple(token_ids.shape)}"
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    picked = logits.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1).to(dtype)
    return picked - torch.logsumexp(logits.to(dtype), dim=-1)
