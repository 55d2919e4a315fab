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
from typing import Any

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
    fsdp: bool = False  # the model is sharded with FSDP2 (`shard_model`)

    def mine(self, rows: list[int], lengths: list[int]) -> list[int]:
        """The rows of `rows` this rank trains on."""
        return rows if self.world == 1 else shard_rows(rows, lengths, self.world)[self.rank]

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, in place (and returned)."""
        return self._all_reduce(t, torch.distributed.ReduceOp.SUM)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s elementwise maximum over the ranks, in place (and returned)."""
        return self._all_reduce(t, torch.distributed.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        if self.world > 1:
            buf = t.to(_comm_device())
            torch.distributed.all_reduce(buf, op=op)
            if buf is not t:
                t.copy_(buf)
        return t

    def most(self, n: int) -> int:
        """The largest `n` over the ranks: with FSDP every rank must run as many forward passes as the busiest."""
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=_comm_device())
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over the ranks in one flat buffer per dtype (a rank whose shard did not
        reach a parameter, e.g. no image for the merger, contributes zeros)."""
        params = [p for p in params if not is_sharded(p)]  # FSDP reduces its own
        if self.world == 1 or not params:
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


def _comm_device() -> torch.device:
    """Where the group's collectives take tensors: the GPU for nccl, the CPU for gloo."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_address(ip: str) -> str:
    """`tcp://ip:port` with a port of this host that is free now, for rank 0 (on `ip`) to offer the others."""
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


def join(
    rank: int, world: int, address: str, backend: str, *, fsdp: bool = False, timeout_s: float = 300.0
) -> RankGroup:
    """Join the learners' torch.distributed group (`backend` nccl on GPUs, gloo on CPUs); blocks until all
    `world` ranks have joined. With `fsdp` a group is formed even for one rank (FSDP2 needs one)."""
    if world > 1 or fsdp:
        torch.distributed.init_process_group(
            backend, init_method=address, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    return RankGroup(rank=rank, world=world, fsdp=fsdp)


def use_fsdp(mode: str, cuda: bool, world: int) -> bool:
    """`train.fsdp`: "on" always, "off" never, "auto" for several ranks on CUDA (on CPUs plain data parallel:
    FSDP2 there only saves memory a CPU box has, at the cost of a gather per layer)."""
    return mode == "on" or (mode == "auto" and cuda and world > 1)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shard_model(vlm: Any, device_type: str, world: int) -> None:
    """FSDP2 over the learner ranks: each decoder layer of the language model is its own unit, the rest of the
    VLM body (embeddings, vision tower, final norm) the root unit; `lm_head` stays whole on every rank (it is
    called in chunks whose number differs between ranks, and a sharded module needs the same calls on all).
    Gradients are summed, not averaged: the loss already divides by the whole mini-batch's normalisers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world,))
    body = vlm.model  # what the learner calls; its forward gathers the root unit's parameters
    units = [*body.language_model.layers, body]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # gloo has no pre-multiplied sum
            unit.set_force_sum_reduction_for_comms(True)


def register_shards(model: torch.nn.Module) -> None:
    """FSDP2: free the unsharded parameters of every unit and register the sharded ones. A forward leaves the
    root unit unsharded (it does not reshard after forward): a write to those copies would be lost at the next
    gather, or land in freed storage. Call it before reading or writing weights outside forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_grads(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the gradients of `params` (sharded and whole ones mixed) to `max_norm`;
    returns the norm before clipping (the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    squares = []
    for g in grads:
        n = torch.linalg.vector_norm(g.float())
        squares.append((n.full_tensor() if is_sharded(n) else n) ** 2)
    total = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank must call it), else `t`."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state of a sharded model, whole (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def laid_out_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`full` (a whole tensor, the same on every rank) with `p`'s device and dtype and, for a sharded parameter,
    its sharding: this rank's shard (a collective then: every rank calls it)."""
    full = full.to(device=p.device, dtype=p.dtype)
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, p.placements)  # type: ignore[attr-defined]


def adapter_file_key(name: str) -> str:
    """The name of a LoRA parameter (`...lora_A.default.weight`) in peft's adapter file (`...lora_A.weight`)."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def load_sharded_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optim_state: dict,
) -> None:
    """Whole adapter weights (peft's file names) and optimizer state into a sharded model: each rank keeps its
    shard (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    with torch.no_grad():
        for name, p in model.named_parameters():
            key = adapter_file_key(name)
            if p.requires_grad and key in weights:
                p.copy_(laid_out_like(weights[key], p))
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state, options=options)
