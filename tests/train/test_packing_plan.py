"""`train.packing`'s plan: sequences into rows of at most the token budget, first-fit decreasing, by hand."""

from __future__ import annotations

from visionrl.train.batching import plan_packed_rows


def test_first_fit_decreasing_by_hand() -> None:
    # lengths 7, 5, 4, 3, 3, 2 (indices 0..5) into rows of 10:
    # 7 -> row A (3 left); 5 -> new row B (5 left); 4 -> B (1 left); 3 (index 3) -> A (0 left);
    # 3 (index 4) -> new row C (7 left); 2 -> C (5 left). Three rows, the least possible (24 tokens > 2 x 10).
    lengths = [3, 7, 2, 5, 3, 4]  # the same lengths in another order: 7 is index 1, 5 index 3, ...
    assert plan_packed_rows(lengths, token_budget=10) == [[1, 0], [3, 5], [4, 2]]
    # equal lengths keep the index order within a row (ties broken by index)
    assert plan_packed_rows([4, 4, 4, 4, 4], token_budget=8) == [[0, 1], [2, 3], [4]]


def test_every_sequence_is_placed_once_and_rows_hold_the_budget() -> None:
    lengths = [(37 * i) % 61 + 5 for i in range(40)]
    rows = plan_packed_rows(lengths, token_budget=128)
    assert sorted(i for row in rows for i in row) == list(range(40))
    assert all(sum(lengths[i] for i in row) <= 128 for row in rows)
    # first fit: a row's room only shrinks, and row r existed before any sequence of a later row was placed, so
    # each sequence of a later row is longer than the room row r has left at the end
    for r, row in enumerate(rows):
        left = 128 - sum(lengths[i] for i in row)
        assert all(lengths[i] > left for later in rows[r + 1 :] for i in later)
    # the total is 1,260 tokens: at least 10 rows of 128; first-fit decreasing needs no more than 11/9 of that + 1
    assert 10 <= len(rows) <= 13


def test_a_sequence_over_the_budget_gets_a_row_of_its_own() -> None:
    assert plan_packed_rows([50, 3, 200, 4], token_budget=64) == [[2], [0, 3, 1]]
    assert plan_packed_rows([], token_budget=64) == []


def test_packing_auto_packs_on_a_gpu_and_pads_on_the_cpu() -> None:
    from visionrl.config import config_from_dict
    from visionrl.train.batching import with_packing_resolved

    raw = {
        "output_dir": "x",
        "model": {"path": "m"},
        "data": {"train": "t.jsonl"},
        "rewards": [{"name": "format"}],
    }
    auto = config_from_dict(raw)
    assert auto.train.packing == "auto"  # the default
    assert with_packing_resolved(auto, "cuda").train.packing is True
    assert with_packing_resolved(auto, "cpu").train.packing is False
    assert auto.train.packing == "auto"  # the job itself is left as written
    for chosen in (True, False):  # an explicit choice holds on either device
        cfg = config_from_dict({**raw, "train": {"packing": chosen}})
        assert [with_packing_resolved(cfg, d).train.packing for d in ("cuda", "cpu")] == [chosen, chosen]
