"""Prompts an engine rejects (longer than its context, more images than it takes, an image its processor
refuses) are skipped one by one, never the batch: the batch is split in halves until the rejected prompts
stand alone. The other prompts are generated once, in the largest sub-batches that pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


def generate_skipping(
    generate: Callable[[list[In]], list[Out]],
    items: Sequence[In],
    rejected: tuple[type[BaseException], ...],
    on_reject: Callable[[int, BaseException], None],
) -> list[Out | None]:
    """`generate(items)` in item order, with None for each item that `generate` rejects on its own.

    When `generate` raises one of `rejected` for a batch, each half is generated on its own (recursively);
    an item rejected alone gets None and `on_reject(its index, the error)`. With k rejected items out of n
    that costs at most about 2 k log2(n) extra calls. Other exceptions propagate.
    """
    out: list[Out | None] = [None] * len(items)

    def run(start: int, stop: int) -> None:
        try:
            results = generate(list(items[start:stop]))
        except rejected as err:
            if stop - start == 1:
                on_reject(start, err)
                return
            middle = (start + stop) // 2
            run(start, middle)
            run(middle, stop)
            return
        out[start:stop] = results

    if items:
        run(0, len(items))
    return out


def vllm_rejections() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request it refuses at validation: `VLLMValidationError` in vLLM 0.32 (not a
    ValueError there: docs/ENGINE_NOTES.md), a ValueError in earlier releases and from the HF processor (e.g. an
    aspect ratio over 200)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # releases before the class existed raise ValueError
        return (ValueError,)
    return (ValueError, VLLMValidationError)
