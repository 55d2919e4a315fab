"""Whether an adapter reaches an engine: compare greedy generations with and without it (the start-up probe)."""

from __future__ import annotations

from visionrl.types import Completion


def largest_first_token_change(before: list[list[Completion]], after: list[list[Completion]]) -> float:
    """Largest |log-prob change| of the first greedy token of each prompt; a changed token counts as inf."""
    change = 0.0
    for b, a in zip(before, after, strict=True):
        if not b or not a:
            continue  # a prompt the engine rejected has no completion to compare
        cb, ca = b[0], a[0]
        if not cb.token_ids or not ca.token_ids:
            continue
        if cb.token_ids[0] != ca.token_ids[0]:
            return float("inf")
        change = max(change, abs(cb.logprobs[0] - ca.logprobs[0]))
    return change
