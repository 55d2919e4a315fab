"""Data-parallel learner ranks: which sequences each rank trains on, and the sums that make N ranks one learner.

Every rank receives the whole rollout batch, computes the loss normalisers of a mini-batch from all of its
sequences (so `token_mean` divides by the tokens of the whole mini-batch, across ranks), and runs forward and
backward only on its shard. Summing the gradients over ranks then gives exactly the gradient of one learner on
the whole mini-batch; every rank applies the same optimizer step to the same weights, so the adapters stay equal
without broadcasting them. Metrics that are sums of per-micro-batch terms are summed the same way.

Shards are balanced by tokens (longest sequence first to the rank with the fewest tokens so far) and computed
by the same pure function on every rank, so no rank has to tell another what it took.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch


def shard_rows(rows: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """Split `rows` (sequence indices; `lengths[r]` = prompt + completion tokens of row r) over `world` ranks:
    each row goes, longest first, to the rank with the fewest tokens so far (the lowest rank on ties). Every row
    lands on exactly one rank; each shard keeps the rows' original order."""
    loads = [0] * world
    owner: dict[int, int] = {}
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        k = min(range(world), key=lambda i: (loads[i], i))
        owner[r] = k
        loads[k] += lengths[r]
    return [[r for r in rows if owner[r] == k] for k in range(world)]


@dataclass
class RankGroup:
    """This process's place among the learner ranks; `world == 1` is the single learner (every call a no-op)."""

    rank: int = 0
    world: int = 1

    def mine(self, rows: list[int], lengths: list[int]) -> list[int]:
        """The rows of `rows` this rank trains on."""
        return rows if self.world == 1 else shard_rows(rows, lengths, self.world)[self.rank]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (and returned)."""
        if self.world > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the ranks in one flat buffer per dtype (a rank whose shard did not
        reach a parameter, e.g. no image for the merger, contributes zeros)."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)  # type: ignore[union-attr]
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])  # type: ignore[union-attr]
            self.sum_(flat)
            offset = 0
            for p in group:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n


def free_address(ip: str) -> str:
    """`tcp://ip:port` with a port of this host that is free now, for rank 0 (on `ip`) to offer the others."""
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


def join(rank: int, world: int, address: str, backend: str, timeout_s: float = 300.0) -> RankGroup:
    """Join the learners' torch.distributed group (`backend` nccl on GPUs, gloo on CPUs); blocks until all
    `world` ranks have joined."""
    if world > 1:
        torch.distributed.init_process_group(
            backend, init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    return RankGroup(rank=rank, world=world)
