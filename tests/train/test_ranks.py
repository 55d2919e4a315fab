"""How learner ranks split a mini-batch: by tokens, every row once, the same on every rank."""

from __future__ import annotations

from visionrl.train.ranks import RankGroup, shard_rows


def test_rows_are_balanced_by_tokens_longest_first() -> None:
    # lengths 10, 3, 7, 7, 1 (rows 0-4). Longest first: row 0 (10) -> rank 0; row 2 (7) -> rank 1 (0 < 10);
    # row 3 (7) -> rank 1 (7 < 10); row 1 (3) -> rank 0 (10 < 14); row 4 (1) -> rank 0 (13 < 14).
    lengths = [10, 3, 7, 7, 1]
    assert shard_rows([0, 1, 2, 3, 4], lengths, 2) == [[0, 1, 4], [2, 3]]
    # a subset keeps its order; more ranks than rows leaves some ranks empty
    assert shard_rows([4, 1], lengths, 3) == [[1], [4], []]
    assert shard_rows([2, 0], lengths, 1) == [[2, 0]]


def test_one_rank_is_the_whole_batch_and_sums_are_identities() -> None:
    import torch

    one = RankGroup()
    assert one.mine([3, 1, 2], [5, 5, 5, 5]) == [3, 1, 2]
    t = torch.tensor([1.0, 2.0])
    assert one.sum_(t) is t and t.tolist() == [1.0, 2.0]
    assert RankGroup(rank=1, world=2).mine([0, 1, 2], [4, 1, 2]) == [1, 2]  # rank 0 takes the 4
