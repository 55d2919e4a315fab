"""The engine/learner consistency measure (`rollout/logprob_diff`) and the adapter versions it compares.

The guard (`rollout.max_logprob_diff`) asks whether the engine samples the policy being trained, so every
sequence is scored by the learner under the adapter version that SAMPLED it. Synchronous steps sample with
the learner's current version; one-step-off rollouts (`rollout.async_steps: 1`) sample with the version
before it, so the learner keeps that version's trainable weights (`AdapterSnapshot`) and scores stale
sequences with them swapped in. Comparing against the current version instead would count one update's
policy change as engine mismatch. Plain functions of tensors and sequences; the learner calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from visionrl.models.sequences import Sequence
from visionrl.train.ranks import RankGroup


@dataclass
class AdapterSnapshot:
    """The trainable weights of one adapter version (same order as the model's trainable parameters)."""

    version: int
    weights: list[torch.Tensor]


def snapshot(params: list[torch.Tensor], version: int) -> AdapterSnapshot:
    return AdapterSnapshot(version, [p.detach().clone() for p in params])


@contextlib.contextmanager
def swapped(params: list[torch.Tensor], snap: AdapterSnapshot | None) -> Iterator[None]:
    """The model runs with `snap`'s weights inside the block (None: unchanged); restored after."""
    if snap is None:
        yield
        return
    current = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, w in zip(params, snap.weights, strict=True):
            p.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, w in zip(params, current, strict=True):
                p.copy_(w)


def sampling_version(seq: Sequence, current: int) -> int:
    return current if seq.adapter_version is None else seq.adapter_version


def rows_by_version(
    seqs: list[Sequence], rows: list[int], current: int, previous: AdapterSnapshot | None
) -> list[tuple[AdapterSnapshot | None, list[int]]]:
    """`rows` grouped by the adapter version that sampled them: (the snapshot to score them with, or None for
    the current weights; rows), previous version first. Both groups are always returned (possibly empty), so
    learner ranks run the same passes. A version the learner no longer holds is a bug of the pipeline."""
    prev_version = previous.version if previous is not None else None
    known = {current} | ({prev_version} if prev_version is not None else set())
    unknown = sorted({sampling_version(seqs[r], current) for r in rows} - known)
    if unknown:
        raise RuntimeError(
            f"sequences sampled with adapter version(s) {unknown}, but the learner holds version {current} and "
            f"keeps only {prev_version} besides it: rollouts may be at most one version old (rollout.async_steps)"
        )
    old = [r for r in rows if sampling_version(seqs[r], current) == prev_version]
    return [(previous, old), (None, [r for r in rows if r not in set(old)])]


def abs_diff_sums(seqs: list[Sequence], rows: list[int], store: dict[int, torch.Tensor]) -> torch.Tensor:
    """[sum over `rows`' tokens of |learner - engine| log-prob, number of tokens] (float64)."""
    local = torch.zeros(2, dtype=torch.float64)
    for r in rows:
        k = len(seqs[r].completion_ids)
        if k:
            samp = torch.tensor(seqs[r].sampling_logprobs[:k], dtype=torch.float32)
            scored = torch.isfinite(samp)  # tokens without a sampling log-prob have nothing to compare
            diff = (store[r][:k] - samp).abs()[scored]
            local += torch.tensor([float(diff.sum()), int(scored.sum())], dtype=torch.float64)
    return local


def engine_mismatch(
    seqs: list[Sequence],
    rows: list[int],
    old: dict[int, torch.Tensor] | None,
    first_diff: float,
    first_tokens: float,
    ranks: RankGroup,
) -> float:
    """Mean |learner - engine| log-prob per token over the whole batch of a synchronous step, every term under
    the adapter version that sampled it: mini-batch 1 from its training forward (before the first update), the
    later ones from the old-log-prob pass (also before any update; `rows`: this rank's). A drifted update must
    not pass for an engine mismatch."""
    if old is None:
        return first_diff
    total, count = ranks.sum_(abs_diff_sums(seqs, rows, old)).tolist()
    total, count = total + first_diff * first_tokens, count + first_tokens
    return total / count if count else 0.0


def staleness(seqs: list[Sequence], current: int) -> float:
    """The learner's version at the update minus the sampling version, averaged over the sequences."""
    if not seqs:
        return 0.0
    return sum(current - sampling_version(s, current) for s in seqs) / len(seqs)
