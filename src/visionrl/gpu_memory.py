"""Accelerator memory figures an actor reports about itself (benchmarks, the start-up log, error messages)."""

from __future__ import annotations


def device_memory() -> dict[str, float]:
    """GiB in use on this process's GPU (all processes), its total, and what this process's torch allocator
    holds now and at its peak; empty without a GPU. vLLM's sleep-mode pool is outside torch's counts."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    g = 2**30
    return {
        "device_used_gib": (total - free) / g,
        "device_total_gib": total / g,
        "reserved_gib": torch.cuda.memory_reserved() / g,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / g,
    }
