"""The learner's side of the start-up delivery probe: adapters that change one part of the model at a time.

An engine could apply the language model's LoRA and skip the merger's, scale B by the wrong alpha / rank, or
take the wrong slices of a fused projection, and a probe that only asks "did anything change?" would pass. So
the probe runs once per adapter part (`PARTS`): the adapter has random non-zero B on that part's LoRA layers
and zero B everywhere else (A as trained), the engine must change its output with it, and the learner, with
the same weights swapped in, must compute the engine's log-probs of the tokens it generated. The weights are a
pure function of the part, the seed and the current A, so the payload sent to the engines and the weights the
learner scores with are built separately and are still the same (`probe_weights`).
"""

from __future__ import annotations

import torch

from visionrl.models.loader import in_vision_tower
from visionrl.train.mismatch import AdapterSnapshot
from visionrl.train.ranks import laid_out_like

LANGUAGE, MERGER = "language model", "merger"
PARTS = (LANGUAGE, MERGER)
PROBE_VERSION = -1  # never a version the learner trains: a probe adapter is never served for rollouts
# B ~ N(0, 0.05^2): moves a greedy log-prob of the tiny and the 8B-shaped model by far over 1e-4
PROBE_STD = 0.05


def part_of(name: str) -> str:
    """The adapter part a LoRA parameter belongs to (the merger's LoRA lives in the vision tower module)."""
    return MERGER if in_vision_tower(name) else LANGUAGE


def probe_parts(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The parts that have LoRA layers in this run (in `PARTS` order): each is probed on its own."""
    present = {part_of(name) for name, _ in named if "lora_B" in name}
    return [part for part in PARTS if part in present]


def probe_weights(named: list[tuple[str, torch.Tensor]], part: str, seed: int) -> AdapterSnapshot:
    """The trainable weights of the probe adapter for `part` (same order as `named`, the trainable parameters):
    random B on `part`'s LoRA layers, zero B on the others, everything else as it is. Sharded parameters get
    their shard of the same whole tensor on every rank."""
    if part not in PARTS:
        raise ValueError(f"unknown adapter part {part!r}; known: {', '.join(PARTS)}")
    gen = torch.Generator().manual_seed(seed + 1 + PARTS.index(part))
    weights = []
    for name, p in named:
        if "lora_B" not in name:
            weights.append(p.detach().clone())
        elif part_of(name) != part:
            weights.append(torch.zeros_like(p))
        else:  # drawn for every B of the part in the same order on every rank
            weights.append(laid_out_like(torch.randn(tuple(p.shape), generator=gen) * PROBE_STD, p))
    return AdapterSnapshot(PROBE_VERSION, weights)
