"""Masked reductions of per-token values [B, T]: ``masked_mean`` and the named loss aggregations.

``mask`` is [B, T], nonzero on real response tokens and zero on padding; values under the mask's zeros
never reach a result or a gradient, even if they are NaN. Aggregations are looked up by name in
``_AGGREGATIONS``; the policy loss, the KL term and the entropy term all go through ``aggregate`` so that
they are weighted the same way.

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

__all__ = ["AGGREGATIONS", "aggregate", "masked_mean"]


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
