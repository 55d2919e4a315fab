"""Rejected prompts are skipped one by one: the rest of the batch is generated, in as few calls as bisection allows."""

from __future__ import annotations

import pytest

from visionrl.rollout.rejects import generate_skipping


class Refused(ValueError):
    pass


def _engine(bad: set[int], calls: list[list[int]]):
    """Generates `item * 10` for each item; refuses any batch holding an item of `bad` (as vLLM refuses a
    batch at validation when one prompt is too long)."""

    def generate(batch: list[int]) -> list[int]:
        calls.append(batch)
        if bad & set(batch):
            raise Refused(f"too long: {sorted(bad & set(batch))}")
        return [x * 10 for x in batch]

    return generate


def test_only_the_rejected_prompts_are_skipped() -> None:
    calls: list[list[int]] = []
    rejected: list[tuple[int, str]] = []
    out = generate_skipping(
        _engine({2, 5}, calls), list(range(8)), (Refused,), lambda i, err: rejected.append((i, str(err)))
    )
    assert out == [0, 10, None, 30, 40, None, 60, 70]
    assert rejected == [(2, "too long: [2]"), (5, "too long: [5]")]
    # Bisection: [0..7] fails; [0..3] fails -> [0,1] ok, [2,3] fails -> [2] refused, [3] ok;
    # [4..7] fails -> [4,5] fails -> [4] ok, [5] refused; [6,7] ok: 11 calls, each good item generated once.
    assert len(calls) == 11
    generated = [x for batch in calls if not {2, 5} & set(batch) for x in batch]
    assert sorted(generated) == [0, 1, 3, 4, 6, 7]


def test_a_clean_batch_is_one_call_and_an_empty_one_none() -> None:
    calls: list[list[int]] = []
    assert generate_skipping(_engine(set(), calls), [1, 2, 3], (Refused,), lambda i, e: None) == [10, 20, 30]
    assert calls == [[1, 2, 3]]
    assert generate_skipping(_engine(set(), calls), [], (Refused,), lambda i, e: None) == []
    assert len(calls) == 1


def test_every_prompt_rejected_gives_all_none() -> None:
    rejected: list[int] = []
    out = generate_skipping(_engine({0, 1, 2}, []), [0, 1, 2], (Refused,), lambda i, e: rejected.append(i))
    assert out == [None, None, None] and rejected == [0, 1, 2]


def test_other_errors_are_not_rejections() -> None:
    def broken(batch: list[int]) -> list[int]:
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        generate_skipping(broken, [1, 2], (Refused,), lambda i, e: None)
