"""The learner's view of a step's prompts: each encoded as the model reads it (placeholders expanded, pixels,
grids, modalities), and each multi-turn episode's sequence with its observations' placeholders expanded."""

from __future__ import annotations

from typing import Any

import torch

from visionrl.models.sequences import EncodedPrompt, Sequence
from visionrl.models.token_prompts import encode_images, expand_episode, expand_placeholders, image_token_id
from visionrl.types import PromptItem


def encode_prompts(processor: Any, config: Any, prompts: list[PromptItem]) -> list[EncodedPrompt]:
    """Each prompt through `processor` (text prompts), or from its token ids (an episode's, `encode_tokens`)."""
    out = []
    for p in prompts:
        if p.token_ids is not None:
            out.append(encode_tokens(processor, config, p))
            continue
        enc = processor(text=[p.text], images=p.images or None, return_tensors="pt")
        mm = enc.get("mm_token_type_ids")
        out.append(
            EncodedPrompt(
                input_ids=enc["input_ids"][0],
                mm_token_type_ids=mm[0] if mm is not None else mm_types(config, enc["input_ids"][0]),
                pixel_values=enc.get("pixel_values"),
                image_grid_thw=enc.get("image_grid_thw"),
            )
        )
    return out


def encode_tokens(processor: Any, config: Any, p: PromptItem) -> EncodedPrompt:
    """An episode's prompt: its token ids (placeholders expanded as the processor does), the pixels of every
    image of the episode (the prompt's, then the observations'), and the observations' token counts."""
    assert p.token_ids is not None
    images = encode_images(processor, p.images)
    ids, used = expand_placeholders(p.token_ids, images.tokens, image_token_id(processor))
    input_ids = torch.tensor(ids, dtype=torch.long)
    return EncodedPrompt(
        input_ids=input_ids,
        mm_token_type_ids=mm_types(config, input_ids),
        pixel_values=images.pixel_values,
        image_grid_thw=images.image_grid_thw,
        later_image_tokens=images.tokens[used:],
    )


def episodes_expanded(
    processor: Any, encoded: list[EncodedPrompt], seqs: list[Sequence]
) -> tuple[list[Sequence], list[list[int] | None]]:
    """Each episode's sequence with its observations' placeholders expanded (`expand_episode`), and where each of
    its original tokens sits (None for a single-turn sequence, unchanged)."""
    pad = image_token_id(processor)
    out: list[Sequence] = []
    positions: list[list[int] | None] = []
    for s in seqs:
        if s.env_mask is None:
            out.append(s)
            positions.append(None)
            continue
        expanded, where = expand_episode(s, encoded[s.prompt].later_image_tokens or [], pad)
        out.append(expanded)
        positions.append(where)
    return out, positions


def mm_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The modality of each token (0 text, 1 image, 2 video) where the processor gives none: M-RoPE places image
    tokens by it, so zeros would silently give them text positions."""
    types = torch.zeros_like(input_ids)
    for kind, key in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, key, None)
        if token is not None:
            types[input_ids == token] = kind
    return types
