"""The learning-rate schedule: linear warm-up, then constant or cosine decay."""

from __future__ import annotations

import math
from typing import Any


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based): linear warm-up, then constant
    or cosine decay to `min_ratio` at `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_rate(scheduler: Any, slot: int) -> None:
    """Put a LambdaLR schedule at `slot` and every parameter group at its rate there. The schedule runs on the
    GRPO step (step k owns slots kU..kU+U-1, U = updates_per_batch), so a skipped update or a step of fewer
    groups than U does not hold it back."""
    scheduler.last_epoch = slot
    factor = scheduler.lr_lambdas[0](slot)
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * factor
