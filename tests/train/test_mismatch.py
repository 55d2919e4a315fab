"""The consistency measure's bookkeeping of adapter versions (train.mismatch), with hand-derived numbers."""

from __future__ import annotations

import pytest
import torch

from visionrl.models.sequences import Sequence
from visionrl.train.mismatch import (
    abs_diff_sums,
    rows_by_version,
    snapshot,
    staleness,
    swapped,
)


def _seq(version: int | None, samp: list[float]) -> Sequence:
    return Sequence(
        prompt=0,
        completion_ids=list(range(len(samp))),
        advantage=0.0,
        sampling_logprobs=samp,
        adapter_version=version,
    )


def test_rows_are_scored_under_the_version_that_sampled_them() -> None:
    seqs = [_seq(4, [0.0]), _seq(5, [0.0]), _seq(None, [0.0]), _seq(4, [0.0])]
    prev = snapshot([torch.zeros(2)], version=4)
    # learner at 5: rows 0 and 3 were sampled with 4 (the snapshot), 1 with 5, 2 unknown = current
    assert rows_by_version(seqs, [0, 1, 2, 3], 5, prev) == [(prev, [0, 3]), (None, [1, 2])]
    # both groups always come back (learner ranks run the same passes), also when one is empty
    assert rows_by_version(seqs, [1], 5, prev) == [(prev, []), (None, [1])]
    assert rows_by_version(seqs[1:3], [0, 1], 5, None) == [(None, []), (None, [0, 1])]


def test_a_version_the_learner_does_not_hold_is_an_error() -> None:
    seqs = [_seq(3, [0.0])]
    with pytest.raises(RuntimeError, match=r"adapter version\(s\) \[3\].*holds version 5 and keeps only 4"):
        rows_by_version(seqs, [0], 5, snapshot([torch.zeros(1)], version=4))
    with pytest.raises(RuntimeError, match="keeps only None"):
        rows_by_version(seqs, [0], 5, None)


def test_abs_diff_sums_counts_each_completion_token_once() -> None:
    seqs = [_seq(0, [-1.0, -2.0]), _seq(0, [-0.5])]
    # row 0: |-1.5 - -1| + |-2 - -2| = 0.5; row 1: |-0.25 - -0.5| = 0.25 (padding past its length ignored)
    store = {0: torch.tensor([-1.5, -2.0, 9.0]), 1: torch.tensor([-0.25, 9.0, 9.0])}
    assert abs_diff_sums(seqs, [0, 1], store).tolist() == [0.75, 3.0]
    assert abs_diff_sums(seqs, [], store).tolist() == [0.0, 0.0]


def test_staleness_is_the_mean_version_gap() -> None:
    # learner at 7: gaps 1, 1, 0 (sampled with 7), 0 (unknown: current) -> 2 / 4
    seqs = [_seq(6, [0.0]), _seq(6, [0.0]), _seq(7, [0.0]), _seq(None, [0.0])]
    assert staleness(seqs, 7) == 0.5
    assert staleness([], 7) == 0.0


def test_swapped_runs_with_the_snapshot_and_restores_the_weights() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    snap = snapshot([w], version=0)
    with torch.no_grad():
        w.add_(10.0)  # an update: now [11, 12]
    with swapped([w], snap):
        assert w.tolist() == [1.0, 2.0]
    assert w.tolist() == [11.0, 12.0]
    with pytest.raises(ValueError), swapped([w], snap):  # restored on an error too
        raise ValueError
    assert w.tolist() == [11.0, 12.0]
    with swapped([w], None):
        assert w.tolist() == [11.0, 12.0]
