"""The losses of GRPO-style training: KL estimators, entropy, token log-probs, and the policy loss.

Pure tensor math, no I/O. Shapes: B sequences (completions) by T padded response tokens. The KL estimators
are looked up by name in ``_KL_KINDS``; they return per-token values, which ``visionrl.algo.aggregation``
reduces the way the policy loss is reduced. The policy loss and its kinds live in ``visionrl.algo.policy_losses``
and are named here too (``losses.policy_loss``, the name the design gives it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from visionrl.algo.policy_losses import policy_loss

__all__ = ["KL_KINDS", "entropy_from_logits", "kl_penalty", "policy_loss", "token_logprobs"]

# k3 is clamped to [-10, 10]; its argument reaches that clamp well inside +-20 (k3(2.7) > 10 and
# k3(-11.1) > 10), so pre-clamping at +-20 changes no value but keeps exp() from overflowing.
_K3_CLAMP = 10.0


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
