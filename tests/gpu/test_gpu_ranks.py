"""The GPU path of the learner ranks: FSDP2 (`fully_shard`) over nccl with one rank on one GPU trains the same
adapter as the plain learner, over two steps with a checkpoint's state round trip between them (bf16 model)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _plain_and_fsdp(
    run: Callable[..., Any], raw: dict, tmp_path: Path, world: int
) -> tuple[dict, dict, dict, dict, float]:
    """Two steps of one plain learner on the GPU and of `world` FSDP2 ranks (one GPU each): (plain adapter,
    FSDP adapter, their last metrics, and how far the plain steps moved the adapter from an untrained run)."""
    plain, m_plain = run(raw, 1, tmp_path / "plain", steps=2, device="cuda")
    fsdp, m_fsdp = run(raw, world, tmp_path / "fsdp", fsdp=True, steps=2, device="cuda")
    still, _ = run({**raw, "train": {**raw["train"], "lr": 1e-12}}, 1, tmp_path / "still", device="cuda")
    assert plain.keys() == fsdp.keys() and len(plain) > 0
    moved = max((plain[k] - still[k]).abs().max().item() for k in plain)
    return plain, fsdp, m_plain, m_fsdp, moved


def test_fsdp_rank_on_the_gpu_trains_the_same_adapter_as_the_plain_learner(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    run_learner_ranks: Callable[..., Any],
    rank_job: Callable[..., dict],
) -> None:
    raw = rank_job(tiny_model, color_data, lr=1e-3, dtype="bfloat16", gradient_checkpointing=True)
    plain, fsdp, m1, m2, moved = _plain_and_fsdp(run_learner_ranks, raw, tmp_path, world=1)
    assert moved > 1e-4  # the steps changed the adapter
    for k in plain:
        # bf16 forward passes: the two paths order their reductions differently
        torch.testing.assert_close(fsdp[k], plain[k], rtol=0, atol=max(2e-3 * moved, 1e-5))
    for key in ("loss/policy", "policy/grad_norm", "learner/tokens"):
        assert m2[key] == pytest.approx(m1[key], rel=2e-2, abs=1e-4), key


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_fsdp_ranks_on_two_gpus_train_the_same_adapter_as_one_rank(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    run_learner_ranks: Callable[..., Any],
    rank_job: Callable[..., dict],
) -> None:
    """2 ranks (one per GPU, nccl, FSDP2) split the step's sequences by tokens and all-reduce with the global
    normalisers: the adapter after two steps is the one a single rank trains on the whole batch."""
    raw = rank_job(tiny_model, color_data, lr=1e-3, dtype="bfloat16", gradient_checkpointing=True)
    one, two, m1, m2, moved = _plain_and_fsdp(run_learner_ranks, raw, tmp_path, world=2)
    assert moved > 1e-4
    for k in one:
        # bf16: two ranks sum their halves' gradients in another order than one rank does
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=max(4e-3 * moved, 1e-5))
    assert m2["learner/tokens"] == pytest.approx(m1["learner/tokens"])  # the global count, not rank 0's share
    assert m2["loss/policy"] == pytest.approx(m1["loss/policy"], rel=2e-2, abs=1e-4)
