"""Turn prompts + completions into padded learner micro-batches under a token budget.

Layout of one micro-batch row: `[left pad | prompt | completion | right pad]`. Prompts are left-padded to the
longest prompt P and completions right-padded to the longest completion T, so every completion token sits
in the same column range [P, P+T) and its logit is at [P-1, P+T-1): the model computes logits only there.
Qwen3-VL derives its M-RoPE positions from the attention mask, so padding does not move any token.
The completions of one group share their prompt's images: with `share_images` each distinct prompt's pixels
are sent once and `image_share` tells the vision tower hooks (`train.forward`) how to hand out the copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visionrl.train.forward import ImageShare, share_plan

# Micro-batch rows are padded to a multiple of this many positions: with a padding mask, SDPA's fused kernels
# want the mask's last dimension aligned; an unaligned one can send attention to a slower path.
SEQ_MULTIPLE = 16


@dataclass
class EncodedPrompt:
    """A prompt as the processor encodes it (image placeholders expanded)."""

    input_ids: torch.Tensor  # [P] long
    mm_token_type_ids: torch.Tensor  # [P] long: 0 text, 1 image, 2 video
    pixel_values: torch.Tensor | None  # [num_patches, patch_dim]
    image_grid_thw: torch.Tensor | None  # [num_images, 3]


@dataclass
class Sequence:
    """One completion with everything the loss needs."""

    prompt: int  # index into the list of EncodedPrompt
    completion_ids: list[int]
    advantage: float
    sampling_logprobs: list[float]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    mm_token_type_ids: torch.Tensor  # [B, P+T]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B]
    sampling_logprobs: torch.Tensor  # [B, T]
    prompt_len: int  # P
    rows: list[int]  # indices of the sequences in the caller's list
    num_tokens: int  # real completion tokens (the mask's sum)
    sequence_tokens: int  # real prompt (image tokens included) + completion tokens
    image_share: ImageShare | None = None  # set when rows share images (pixel_values holds each once)


def plan_micro_batches(lengths: list[tuple[int, int]], token_budget: int) -> list[list[int]]:
    """Group sequence indices so each group's padded size (rows x (max prompt + max completion)) fits the budget.

    `lengths[i] = (prompt_len, completion_len)`. Sequences are taken longest first so similar lengths share a
    micro-batch (less padding). A sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -(lengths[i][0] + lengths[i][1]))
    groups: list[list[int]] = []
    current: list[int] = []
    max_p = max_t = 0
    for i in order:
        p, t = lengths[i]
        new_p, new_t = max(max_p, p), max(max_t, t)
        if current and (len(current) + 1) * (new_p + new_t) > token_budget:
            groups.append(current)
            current, new_p, new_t = [], p, t
        current.append(i)
        max_p, max_t = new_p, new_t
    if current:
        groups.append(current)
    return groups


def collate(
    prompts: list[EncodedPrompt],
    seqs: list[Sequence],
    rows: list[int],
    pad_id: int,
    *,
    share_images: bool = False,
    merge_size: int = 2,
) -> MicroBatch:
    """Pad the sequences `rows` into one MicroBatch (layout in the module docstring)."""
    chosen = [seqs[r] for r in rows]
    P = max(len(prompts[s.prompt].input_ids) for s in chosen)
    T = max(max(len(s.completion_ids), 1) for s in chosen)
    T += (-(P + T)) % SEQ_MULTIPLE  # a row length the attention kernels take without re-padding the mask
    B = len(chosen)
    input_ids = torch.full((B, P + T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, P + T), dtype=torch.long)
    mm_types = torch.zeros((B, P + T), dtype=torch.long)
    comp = torch.full((B, T), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((B, T))
    samp = torch.zeros((B, T))
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    sources: list[int] = []
    distinct: dict[int, int] = {}
    for b, s in enumerate(chosen):
        ep = prompts[s.prompt]
        n, k = len(ep.input_ids), len(s.completion_ids)
        input_ids[b, P - n : P] = ep.input_ids
        mm_types[b, P - n : P] = ep.mm_token_type_ids
        attention[b, P - n : P + k] = 1
        if k:
            ids = torch.tensor(s.completion_ids, dtype=torch.long)
            input_ids[b, P : P + k] = ids
            comp[b, :k] = ids
            comp_mask[b, :k] = 1.0
            samp[b, :k] = torch.tensor(s.sampling_logprobs[:k], dtype=torch.float32)
        if ep.pixel_values is not None and ep.image_grid_thw is not None:
            grids.append(ep.image_grid_thw)
            key = s.prompt if share_images else -1 - b  # without sharing every row is its own source
            if key not in distinct:
                distinct[key] = len(distinct)
                pixels.append(ep.pixel_values)
            sources.append(distinct[key])
    share = None
    if pixels and len(pixels) < len(grids):
        unique_grids = [grids[sources.index(u)] for u in range(len(pixels))]
        share = share_plan(unique_grids, sources, merge_size)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mm_token_type_ids=mm_types,
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.cat(grids) if grids else None,
        completion_ids=comp,
        completion_mask=comp_mask,
        advantages=torch.tensor([s.advantage for s in chosen], dtype=torch.float32),
        sampling_logprobs=samp,
        prompt_len=P,
        rows=list(rows),
        num_tokens=int(comp_mask.sum()),
        sequence_tokens=int(attention.sum()),
        image_share=share,
    )
