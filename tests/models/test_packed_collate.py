"""A packed micro-batch by hand: where each sequence sits, its images, and its own position ids."""

from __future__ import annotations

import torch

from visionrl.models.packing import collate_packed, packed_position_ids
from visionrl.models.sequences import EncodedPrompt, Sequence, collate


def _prompts() -> list[EncodedPrompt]:
    # prompt 0: 5 tokens, 2 of them the placeholders of one image (grid 1x2x4 -> 2 merged tokens at merge 2);
    # prompt 1: 3 text tokens, no image
    ids0 = torch.tensor([10, 11, 9, 9, 12])
    return [
        EncodedPrompt(ids0, (ids0 == 9).long(), torch.ones(8, 6), torch.tensor([[1, 2, 4]])),
        EncodedPrompt(torch.tensor([20, 21, 22]), torch.zeros(3, dtype=torch.long), None, None),
    ]


def test_sequences_sit_end_to_end_with_their_completions_and_images() -> None:
    prompts = _prompts()
    nan = float("nan")
    seqs = [
        Sequence(
            0, [1, 2, 3, 4], 1.0, [-1.0, nan, -1.0, -1.0]
        ),  # a token without a log-prob: not in the loss
        Sequence(1, [5, 6], -1.0, [-2.0, -2.0]),
        Sequence(0, [7], 0.5, [-3.0]),
    ]
    mb = collate_packed(prompts, seqs, [1, 0, 2], pad_id=0)
    # segments: seq 1 (3 + 2 = 5 tokens) at 0:5, seq 0 (5 + 4 = 9) at 5:14, seq 2 (5 + 1 = 6) at 14:20,
    # padding to 32 (a multiple of 16) at 20:32
    assert mb.segments is not None and mb.segments.bounds == [0, 5, 14, 20, 32]
    assert mb.segments.images == [0, 1, 1, 0]
    assert mb.input_ids.shape == (1, 32)
    assert mb.input_ids[0, :20].tolist() == [
        20,
        21,
        22,
        5,
        6,
        10,
        11,
        9,
        9,
        12,
        1,
        2,
        3,
        4,
        10,
        11,
        9,
        9,
        12,
        7,
    ]
    assert mb.mm_token_type_ids[0].nonzero().squeeze(-1).tolist() == [7, 8, 16, 17]
    assert mb.starts.tolist() == [3, 10, 19]  # each completion's first column in the row
    assert mb.hidden_rows is not None and mb.hidden_rows.tolist() == [0, 0, 0]
    # the per-sequence fields are the padded micro-batch's, row for row
    padded = collate(prompts, seqs, [1, 0, 2], pad_id=0)
    for name in ("completion_ids", "completion_mask", "sampling_logprobs", "advantages"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name
    assert mb.completion_mask.tolist() == [[1, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]]
    assert mb.num_tokens == 6 and mb.sequence_tokens == 20 and padded.sequence_tokens == 20
    # two images (both prompt 0's), in sequence order; shared, the pixels are sent once and handed out twice
    assert mb.image_grid_thw.tolist() == [[1, 2, 4], [1, 2, 4]] and mb.pixel_values.shape == (16, 6)
    shared = collate_packed(prompts, seqs, [1, 0, 2], pad_id=0, share_images=True)
    assert shared.pixel_values.shape == (8, 6) and shared.image_share is not None
    assert shared.image_share.token_index.tolist() == [0, 1, 0, 1]


def test_each_segment_gets_its_own_positions_and_grids() -> None:
    prompts = _prompts()
    seqs = [
        Sequence(0, [1, 2], 1.0, [-1.0] * 2),
        Sequence(1, [5], 1.0, [-1.0]),
        Sequence(0, [3], 1.0, [-1.0]),
    ]
    mb = collate_packed(prompts, seqs, [0, 1, 2], pad_id=0)
    assert mb.segments is not None and mb.segments.bounds == [0, 7, 11, 17, 32]
    calls = []

    def rope_index(ids: torch.Tensor, mm: torch.Tensor, image_grid_thw: torch.Tensor | None = None):
        # a stand-in for the model's get_rope_index: 10 x the column within the segment, + 1 on image tokens
        calls.append((ids.shape, None if image_grid_thw is None else image_grid_thw.tolist()))
        pos = 10 * torch.arange(ids.shape[1]) + mm[0]
        return pos.view(1, 1, -1).expand(3, 1, -1), torch.zeros(1, 1)

    pos = packed_position_ids(rope_index, mb)
    assert pos.shape == (4, 1, 32)
    # one call per segment (the padding's too), each with that segment's own image grids only
    assert calls == [((1, 7), [[1, 2, 4]]), ((1, 4), None), ((1, 6), [[1, 2, 4]]), ((1, 15), None)]
    # text positions restart at 0 in every segment: that is what bounds the attention
    want_text = [*range(7), *range(4), *range(6), *range(15)]
    assert pos[0, 0].tolist() == want_text
    # M-RoPE rows: each segment's own, from its first column (image tokens at columns 2, 3 and 13, 14)
    mm = mb.mm_token_type_ids[0]
    assert pos[1, 0].tolist() == [10 * t + int(m) for t, m in zip(want_text, mm, strict=True)]
    assert torch.equal(pos[1], pos[3])
