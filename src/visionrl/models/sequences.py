"""Sequences as the model reads them: an encoded prompt, a completion to score, and the padded micro-batch of
rows that the learner (`visionrl.train`) and the tiny model's pre-training (`visionrl.models.pretrain`) feed it.

Layout of one micro-batch row: `[prompt | completion | pad]`, all padding at the end. Under causal attention a
real token attends only to earlier positions, which are all real, so the model runs without an attention mask:
outputs at real positions are exact, M-RoPE positions of real tokens are unchanged, and attention keeps its fused
causal kernel (a padding mask sends SDPA to a slower path; completions of spread lengths made that 2.5x slower,
docs/ENGINE_NOTES.md). Row b's completion starts at column `starts[b]`; the logit of its token t sits at
`starts[b] - 1 + t`.
With `train.packing` the sequences sit end to end in one row instead (`visionrl.models.packing`).
The completions of one group share their prompt's images: with `share_images` each distinct prompt's pixels
are sent once, and `image_share` tells the vision tower hooks (`train.forward.SharedImages`) how to hand out
the copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Micro-batch rows are padded to a multiple of this many positions (aligned shapes for the attention kernels).
SEQ_MULTIPLE = 16


@dataclass
class ImageShare:
    """How a micro-batch's images map onto the distinct ones actually encoded.

    `grid_thw` is the per-row grid ([num_images, 3], what M-RoPE and the placeholder check need); the vision
    tower runs on `unique_grid_thw` only, and `token_index[k]` names the encoded merged token that the k-th image
    token of the micro-batch copies.
    """

    unique_grid_thw: torch.Tensor  # [num_unique, 3] long
    token_index: torch.Tensor  # [num_image_tokens] long


@dataclass
class EncodedPrompt:
    """A prompt as the processor encodes it (image placeholders expanded)."""

    input_ids: torch.Tensor  # [P] long
    mm_token_type_ids: torch.Tensor  # [P] long: 0 text, 1 image, 2 video
    pixel_values: torch.Tensor | None  # [num_patches, patch_dim]
    image_grid_thw: torch.Tensor | None  # [num_images, 3]
    # an episode: the merged tokens of each image its completion shows (observations), after the prompt's own
    later_image_tokens: list[int] | None = None


@dataclass
class Sequence:
    """One completion with everything the loss needs."""

    prompt: int  # index into the list of EncodedPrompt
    completion_ids: list[int]
    advantage: float
    sampling_logprobs: list[float]
    adapter_version: int | None = None  # the version that sampled it (None: the learner's current one)
    # tokens the rollout correction's mask mode leaves out of the loss (None: none), set before the update
    masked: list[bool] | None = None
    # a multi-turn episode: True where the environment wrote the token (observations, tool results, template
    # glue), never in the loss nor its token counts; and the modality of each completion token (1: an image's)
    env_mask: list[bool] | None = None
    completion_mm: list[int] | None = None

    def scored(self) -> torch.Tensor:
        """[k] bool: the completion tokens in the loss (and in its normalisers): those with a finite sampling
        log-prob, not `masked` and not the environment's. A token the engine returned none for (NaN) stays in
        the context but leaves the loss: as the old policy it would make the whole update NaN."""
        k = len(self.completion_ids)
        keep = torch.isfinite(torch.tensor(self.sampling_logprobs[:k], dtype=torch.float32))
        for drop in (self.masked, self.env_mask):
            if drop is not None:
                keep &= ~torch.tensor(drop[:k], dtype=torch.bool)
        return keep

    def sampled_ids(self) -> list[int]:
        """The completion tokens the model sampled (an episode's environment tokens left out)."""
        if self.env_mask is None:
            return self.completion_ids
        return [t for t, env in zip(self.completion_ids, self.env_mask, strict=True) if not env]


@dataclass
class PackedSegments:
    """Where the sequences of a packed row sit: segment j spans columns bounds[j]:bounds[j + 1] (the last segment
    is the row's padding when there is any), and holds `images[j]` of the micro-batch's images, in order."""

    bounds: list[int]
    images: list[int]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]: 1 on real tokens (all padding is at the end of a row)
    mm_token_type_ids: torch.Tensor  # [B, L]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor  # [B]
    sampling_logprobs: torch.Tensor  # [B, T]
    starts: torch.Tensor  # [B] long: the column of each row's first completion token (its prompt length)
    rows: list[int]  # indices of the sequences in the caller's list
    num_tokens: int  # real completion tokens (the mask's sum)
    sequence_tokens: int  # real prompt (image tokens included) + completion tokens
    image_share: ImageShare | None = None  # set when rows share images (pixel_values holds each once)
    # a packed micro-batch (`models.packing`): one row of B sequences end to end; the per-sequence fields above
    # ([B, T], [B]) keep their meaning, `starts` counts columns of that row
    segments: PackedSegments | None = None

    @property
    def hidden_rows(self) -> torch.Tensor | None:
        """[B]: the input row each sequence sits in (all in row 0 when packed); None: sequence b is row b."""
        return None if self.segments is None else torch.zeros(len(self.rows), dtype=torch.long)

    def rows_of(self, store: dict[int, torch.Tensor]) -> torch.Tensor:
        """[B, T]: each row's per-token values from `store` (sequence index -> [k]), cut or zero-padded to T."""
        T = self.completion_ids.shape[1]
        return torch.stack(
            [torch.nn.functional.pad(store[r][:T], (0, max(0, T - len(store[r])))) for r in self.rows]
        )


def without_tokens(seqs: list[Sequence], token_ids: set[int]) -> tuple[list[Sequence], int]:
    """The sequences whose completions hold none of `token_ids`, and how many were left out. A sampled vision
    token would be read as a placeholder for image features that do not exist, which fails the whole forward."""
    kept = [
        s for s in seqs if token_ids.isdisjoint(s.sampled_ids())
    ]  # an observation's image tokens are real
    return kept, len(seqs) - len(kept)


def share_plan(grids: list[torch.Tensor], sources: list[int], merge: int) -> ImageShare | None:
    """The `ImageShare` for images whose grids are `grids` (one [n_i, 3] tensor per distinct prompt, in order)
    and where row-image block j copies distinct block `sources[j]`; None when nothing repeats."""
    if len(set(sources)) == len(sources):
        return None
    counts = [int(g.prod(-1).sum()) // (merge * merge) for g in grids]
    offsets = [0]
    for c in counts[:-1]:
        offsets.append(offsets[-1] + c)
    index = torch.cat([torch.arange(offsets[s], offsets[s] + counts[s]) for s in sources])
    return ImageShare(unique_grid_thw=torch.cat(grids), token_index=index)


def sequence_tokens(prompt: EncodedPrompt, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids [n + k] of the prompt followed by the completion, and the modality of each (an episode's
    completion holds its observations' image tokens)."""
    k = len(seq.completion_ids)
    ids = torch.cat([prompt.input_ids, torch.tensor(seq.completion_ids, dtype=torch.long)])
    mm = (
        torch.zeros(k, dtype=torch.long) if seq.completion_mm is None else torch.tensor(seq.completion_mm[:k])
    )
    return ids, torch.cat([prompt.mm_token_type_ids, mm.long()])


def completion_tensors(
    chosen: list[Sequence], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, T] per sequence: completion ids (pad after the end), the mask of the tokens in the loss, and the
    sampling log-probs (0 where there is none)."""
    T = max(max(len(s.completion_ids), 1) for s in chosen)
    comp = torch.full((len(chosen), T), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((len(chosen), T))
    samp = torch.zeros((len(chosen), T))
    for b, s in enumerate(chosen):
        k = len(s.completion_ids)
        if k:
            comp[b, :k] = torch.tensor(s.completion_ids, dtype=torch.long)
            comp_mask[b, :k] = s.scored().float()  # no log-prob, or masked by the correction: not in the loss
            samp[b, :k] = torch.tensor(s.sampling_logprobs[:k], dtype=torch.float32).nan_to_num(0.0)
    return comp, comp_mask, samp


def gather_images(
    prompts: list[EncodedPrompt], chosen: list[Sequence], share_images: bool, merge_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, ImageShare | None]:
    """The pixels and grids of the images of the sequences `chosen`, in their order (the order of their image
    placeholders in the micro-batch), and with `share_images` each distinct prompt's pixels once plus the plan
    that hands out the copies."""
    pixels: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    sources: list[int] = []
    distinct: dict[int, int] = {}
    for b, s in enumerate(chosen):
        ep = prompts[s.prompt]
        if ep.pixel_values is None or ep.image_grid_thw is None:
            continue
        grids.append(ep.image_grid_thw)
        key = s.prompt if share_images else -1 - b  # without sharing every sequence is its own source
        if key not in distinct:
            distinct[key] = len(distinct)
            pixels.append(ep.pixel_values)
        sources.append(distinct[key])
    share = None
    if pixels and len(pixels) < len(grids):
        unique_grids = [grids[sources.index(u)] for u in range(len(pixels))]
        share = share_plan(unique_grids, sources, merge_size)
    return torch.cat(pixels) if pixels else None, torch.cat(grids) if grids else None, share


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
    L = max(len(prompts[s.prompt].input_ids) + max(len(s.completion_ids), 1) for s in chosen)
    L += (-L) % SEQ_MULTIPLE
    B = len(chosen)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    mm_types = torch.zeros((B, L), dtype=torch.long)
    starts = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(chosen):
        ids, mm = sequence_tokens(prompts[s.prompt], s)
        input_ids[b, : len(ids)] = ids
        mm_types[b, : len(ids)] = mm
        attention[b, : len(ids)] = 1
        starts[b] = len(prompts[s.prompt].input_ids)
    return micro_batch(prompts, chosen, rows, pad_id, (input_ids, attention, mm_types, starts),
                       share_images=share_images, merge_size=merge_size)  # fmt: skip


def micro_batch(
    prompts: list[EncodedPrompt],
    chosen: list[Sequence],
    rows: list[int],
    pad_id: int,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    share_images: bool,
    merge_size: int,
    segments: PackedSegments | None = None,
) -> MicroBatch:
    """The MicroBatch of `chosen` (the sequences `rows`) laid out as `layout` (input ids, attention mask, token
    types, completion starts: padded rows or a packed row), with their completions, advantages and images."""
    input_ids, attention, mm_types, starts = layout
    comp, comp_mask, samp = completion_tensors(chosen, pad_id)
    pixel_values, grid_thw, share = gather_images(prompts, chosen, share_images, merge_size)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention,
        mm_token_type_ids=mm_types,
        pixel_values=pixel_values,
        image_grid_thw=grid_thw,
        completion_ids=comp,
        completion_mask=comp_mask,
        advantages=torch.tensor([s.advantage for s in chosen], dtype=torch.float32),
        sampling_logprobs=samp,
        starts=starts,
        rows=list(rows),
        num_tokens=int(comp_mask.sum()),
        sequence_tokens=int(attention.sum()),
        image_share=share,
        segments=segments,
    )
