"""Completion lengths of the GPU benchmarks' spread rows, free of vLLM: the draw (uniform in [T/8, T]), the log the
engine's logits processor appends its draws to, and the histogram a results row carries. Shared by the learner-only
benchmark (gpu_learner.py) and the engine's processor (length_spread.py)."""

from __future__ import annotations

import random
from typing import Any


def draw_length(rng: random.Random, max_tokens: int) -> int:
    """A length uniform in [max(1, T // 8), T]."""
    return rng.randint(max(1, max_tokens // 8), max_tokens)


def read_lengths(log: Any) -> list[int]:
    """The lengths appended to `log`, one per line (none if it does not exist)."""
    try:
        with open(log, encoding="utf-8") as f:
            return [int(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def histogram(lengths: list[int], max_tokens: int, bins: int = 8) -> list[dict[str, int]]:
    """Counts of `lengths` in `bins` equal bins of [1, max_tokens]."""
    width = max(1, -(-max_tokens // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, max(0, (n - 1) // width))] += 1
    return [
        {"from": i * width + 1, "to": min(max_tokens, (i + 1) * width), "count": c}
        for i, c in enumerate(counts)
    ]


def histogram_line(bins: list[dict[str, int]]) -> str:
    """`1-64: 7  65-128: 287 ...`: a histogram on one line."""
    return "  ".join(f"{b['from']}-{b['to']}: {b['count']}" for b in bins)
