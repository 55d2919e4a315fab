"""Which sequences share a learner micro-batch under a token budget. The padded rows of one micro-batch
(`[prompt | completion | pad]`) are `visionrl.models.sequences`' `collate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from visionrl.config import JobConfig

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


def plan_packed_rows(lengths: list[int], token_budget: int) -> list[list[int]]:
    """`train.packing`: sequence indices packed into rows of at most `token_budget` tokens (`lengths[i]`: prompt +
    completion of sequence i), each row one micro-batch with its sequences end to end (`models.packing`).

    First-fit decreasing: the longest sequence first, each into the first row with room, else a new row, so rows
    fill up and their number stays near the least possible (within 11/9 of it). A sequence longer than the
    budget gets a row of its own. Each row lists its sequences in the order they sit in it.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        fit = next((r for r, left in enumerate(room) if n <= left), None)
        if fit is None:
            rows.append([i])
            room.append(token_budget - n)
        else:
            rows[fit].append(i)
            room[fit] -= n
    return rows


def with_packing_resolved(cfg: JobConfig, device_type: str) -> JobConfig:
    """`cfg` with `train.packing: auto` decided for a learner on `device_type`: packed rows on a GPU (where a
    varlen kernel keeps spread completion lengths at the equal-length speed), padded rows on the CPU."""
    if cfg.train.packing != "auto":
        return cfg
    train = cfg.train.model_copy(update={"packing": device_type == "cuda"})
    return cfg.model_copy(update={"train": train})
