"""Padding-free micro-batches (`train.packing`): several sequences end to end in one row, each as if alone.

Layout: `[prompt 0 | completion 0 | prompt 1 | completion 1 | ... | pad]`, one row (batch 1), padded at its end to
a multiple of `SEQ_MULTIPLE`. Three things keep each sequence on its own (docs/ENGINE_NOTES.md, "Packed
sequences"):
- M-RoPE positions are computed per sequence (`packed_position_ids`), so each restarts at 0 as in its own row;
- the text row of the 4-row position ids restarts at 0 with each sequence: transformers reads the restarts as
  sequence boundaries (a document mask for SDPA and eager, cu_seqlens for FlashAttention 2), so attention never
  crosses from one sequence into another; with `train.packed_attention` the learner passes the boundaries as
  cu_seqlens to a varlen kernel instead (`models.packed_attention`);
- the images of all sequences are sent in sequence order, so the vision tower's features fill each sequence's
  placeholders in turn.
The per-sequence fields of the `MicroBatch` ([B, T] completions, masks, advantages) are those of the padded one;
`starts` are columns of the packed row, and `hidden_rows` sends every sequence to row 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from visionrl.models.sequences import (
    SEQ_MULTIPLE,
    EncodedPrompt,
    MicroBatch,
    PackedSegments,
    Sequence,
    micro_batch,
    sequence_tokens,
)

# `model.get_rope_index(input_ids [1, n], mm_token_type_ids [1, n], image_grid_thw=...)` of Qwen3-VL and
# Qwen2.5-VL: the [3, 1, n] M-RoPE positions of one sequence (and the deltas, unused here).
RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def collate_packed(
    prompts: list[EncodedPrompt],
    seqs: list[Sequence],
    rows: list[int],
    pad_id: int,
    *,
    share_images: bool = False,
    merge_size: int = 2,
) -> MicroBatch:
    """The sequences `rows` end to end in one row, in that order (layout in the module docstring)."""
    chosen = [seqs[r] for r in rows]
    parts = [sequence_tokens(prompts[s.prompt], s) for s in chosen]
    bounds = [0]
    for ids, _ in parts:
        bounds.append(bounds[-1] + len(ids))
    real = bounds[-1]
    L = real + (-real) % SEQ_MULTIPLE
    if L > real:  # the padding is a segment of its own: it attends only to itself
        bounds.append(L)
    input_ids = torch.full((1, L), pad_id, dtype=torch.long)
    input_ids[0, :real] = torch.cat([ids for ids, _ in parts])
    mm_types = torch.zeros((1, L), dtype=torch.long)
    mm_types[0, :real] = torch.cat([mm for _, mm in parts])
    attention = torch.zeros((1, L), dtype=torch.long)
    attention[0, :real] = 1
    starts = torch.tensor(
        [b + len(prompts[s.prompt].input_ids) for b, s in zip(bounds[: len(chosen)], chosen, strict=True)]
    )
    grids = [prompts[s.prompt].image_grid_thw for s in chosen]
    images = [0 if g is None else len(g) for g in grids]
    segments = PackedSegments(bounds=bounds, images=images + [0] * (len(bounds) - 1 - len(chosen)))
    return micro_batch(prompts, chosen, rows, pad_id, (input_ids, attention, mm_types, starts),
                       share_images=share_images, merge_size=merge_size, segments=segments)  # fmt: skip


def packed_position_ids(rope_index: RopeIndex, mb: MicroBatch) -> torch.Tensor:
    """[4, 1, L] position ids of a packed micro-batch: row 0 the text positions (0, 1, ... within each segment,
    which is what marks the boundaries for the attention), rows 1-3 the M-RoPE positions of each segment computed
    on its own (`rope_index`, the model's `get_rope_index`), as the padded row of that sequence would have them."""
    assert mb.segments is not None, "packed_position_ids needs a packed micro-batch (models.packing)"
    bounds, images = mb.segments.bounds, mb.segments.images
    L = mb.input_ids.shape[1]
    positions = torch.zeros((4, 1, L), dtype=torch.long)
    first = 0  # the segment's first image among the micro-batch's grids
    for j in range(len(bounds) - 1):
        lo, hi = bounds[j], bounds[j + 1]
        positions[0, 0, lo:hi] = torch.arange(hi - lo)
        grid = None
        if images[j] and mb.image_grid_thw is not None:
            grid = mb.image_grid_thw[first : first + images[j]]
            first += images[j]
        ids, mm = mb.input_ids[:, lo:hi], mb.mm_token_type_ids[:, lo:hi]
        positions[1:, :, lo:hi] = rope_index(ids, mm, image_grid_thw=grid)[0]
    return positions
