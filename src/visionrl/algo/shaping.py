"""Reward shaping that depends on the completion rather than its answer: DAPO's overlong penalty.

A completion cut off at the generation budget has no answer to grade; DAPO's soft overlong punishment
adds a length penalty that ramps up over the last ``buffer`` tokens of the budget, so the policy learns to
finish early rather than being hit by a cliff at ``max_length``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int, factor: float = 1.0) -> Tensor:
    """Per-completion length penalty (DAPO's soft overlong punishment), to add to the rewards.

    With ``start = max_length - buffer``: 0 where ``length <= start``; ``-factor * (length - start) /
    buffer`` for ``start < length <= max_length`` (so ``-factor`` at ``max_length``); ``-factor`` beyond.

    Args:
        lengths: completion lengths in tokens, any shape (integer or floating).
        max_length: the generation budget in tokens.
        buffer: the width of the ramp, in (0, max_length].
        factor: the penalty at ``max_length`` (its magnitude), >= 0.

    Returns:
        A floating tensor shaped like ``lengths`` (integer lengths give the default float dtype), <= 0.
    """
    if not buffer > 0:
        raise ValueError(f"buffer must be > 0 (the ramp's width in tokens), got {buffer!r}")
    if not buffer <= max_length:
        raise ValueError(f"buffer must be <= max_length={max_length!r}, got buffer={buffer!r}")
    if not factor >= 0:
        raise ValueError(f"factor must be >= 0 (the penalty's magnitude), got {factor!r}")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    excess = (lengths.to(dtype) - (max_length - buffer)).clamp(0.0, float(buffer))
    return -factor * excess / buffer
