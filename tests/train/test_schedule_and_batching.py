"""Pure parts of the learner: the token-budget micro-batch plan and the learning-rate schedule."""

from __future__ import annotations

import pytest

from visionrl.train.batching import plan_micro_batches
from visionrl.train.learner import lr_lambda


def test_plan_micro_batches_respects_the_budget() -> None:
    # (prompt, completion) lengths; padded size of a group = rows x longest (prompt + completion) of the group.
    lengths = [(10, 5), (10, 1), (12, 2), (8, 8)]  # rows of 15, 11, 14, 16 tokens
    plan = plan_micro_batches(lengths, token_budget=32)
    # Longest first: 16 alone; + 15 -> 2 x 16 = 32 fits; + 14 -> 3 x 16 = 48 does not: new group 14;
    # + 11 -> 2 x 14 = 28 fits.
    assert plan == [[3, 0], [2, 1]]
    for group in plan:
        assert len(group) * max(sum(lengths[i]) for i in group) <= 32
    assert plan_micro_batches([(40, 10), (1, 1)], token_budget=32) == [[0], [1]]  # too long: alone


def test_lr_schedule_warmup_then_cosine() -> None:
    # warm-up 2 of 10 steps: 1/2, 2/2; then cosine from 1 to min 0.1 over the 8 remaining steps.
    assert lr_lambda(0, 2, 10, "cosine", 0.1) == pytest.approx(0.5)
    assert lr_lambda(1, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(2, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(6, 2, 10, "cosine", 0.1) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos(pi/2)=0
    assert lr_lambda(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(7, 0, 10, "constant", 0.1) == 1.0


def test_micro_batch_rows_are_padded_to_a_multiple_of_16() -> None:
    import torch

    from visionrl.models.sequences import SEQ_MULTIPLE, EncodedPrompt, Sequence, collate

    # prompts of 5 and 3 tokens, completions of 4 and 2: rows of 9 and 5 tokens, padded at the end to 16
    prompts = [
        EncodedPrompt(torch.arange(5), torch.zeros(5, dtype=torch.long), None, None),
        EncodedPrompt(torch.arange(3), torch.zeros(3, dtype=torch.long), None, None),
    ]
    seqs = [Sequence(0, [1, 2, 3, 4], 1.0, [-1.0] * 4), Sequence(1, [5, 6], -1.0, [-2.0] * 2)]
    mb = collate(prompts, seqs, [0, 1], pad_id=0)
    assert SEQ_MULTIPLE == 16 and mb.input_ids.shape == (2, 16) and mb.completion_ids.shape == (2, 4)
    assert mb.completion_mask.sum(1).tolist() == [4.0, 2.0]
    assert mb.starts.tolist() == [5, 3]  # each completion right after its own prompt
    assert mb.input_ids[1, :5].tolist() == [0, 1, 2, 5, 6] and mb.attention_mask.sum(1).tolist() == [9, 5]
    assert mb.num_tokens == 6 and mb.sequence_tokens == 5 + 4 + 3 + 2
