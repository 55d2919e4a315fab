"""The learning-rate schedule: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): linear warm-up, then constant
    or cosine decay to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
