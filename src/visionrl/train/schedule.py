"""The optimizer's clock: the learning-rate schedule (linear warm-up, then constant or cosine decay) and the
step itself, taken only when the loss and gradients are finite."""

from __future__ import annotations

import math
from typing import Any

from visionrl.errors import NonFiniteError


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


def step_if_finite(optimizer: Any, loss: float, grad_norm: float, on_nonfinite: str) -> bool:
    """Take the optimizer step unless the loss or the gradient norm is NaN or infinite. A non-finite step is
    never applied (AdamW would turn every weight it touches into NaN, for good): with `train.on_nonfinite: skip`
    the gradients are dropped and False returned, with `stop` it raises."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        optimizer.step()
        return True
    optimizer.zero_grad(set_to_none=True)
    if on_nonfinite == "stop":
        raise NonFiniteError(
            f"a learner update had a non-finite loss ({loss}) or gradient norm ({grad_norm}) and was not "
            "applied; the adapter is the one of the last finite update. train.on_nonfinite=stop ends the run "
            "here. Likely causes: a learning rate too high for this model (train.lr), rewards or advantages out "
            "of range, or float16 overflow (model.dtype=bfloat16); on_nonfinite=skip skips such updates instead"
        )
    return False
