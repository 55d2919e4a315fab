"""Which sequences share a learner micro-batch under a token budget. The padded rows of one micro-batch
(`[prompt | completion | pad]`) are `visionrl.models.sequences`' `collate`.
"""

from __future__ import annotations

# Default token budget of the no-gradient passes (`train.logprob_batch_tokens`): no activations are kept, so they
# take larger micro-batches than training; measured on the H200 in benchmarks/NOTES-gpu-learner.md.
NO_GRAD_BATCH_TOKENS = 16384


def plan_micro_batches(lengths: list[tuple[int, int]], token_budget: int) -> list[list[int]]:
    """Group sequence indices so each group's padded size (rows x longest prompt + completion) fits the budget.

    `lengths[i] = (prompt_len, completion_len)`. Sequences are taken longest first so similar lengths share a
    micro-batch (less padding). A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -(lengths[i][0] + lengths[i][1]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i][0] + lengths[i][1]
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
