"""Token prompts: a conversation as the engine reads it (token ids with one `<|image_pad|>` per image) turned into
what the model reads (each placeholder expanded to the image's merged patches, the pixels, the grids), exactly as
the processor expands a text prompt. The vLLM engine expands such prompts itself; the HF engine and the learner
use this module, so all three read the same tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from PIL import Image

from visionrl.models.sequences import Sequence


@dataclass
class EncodedImages:
    pixel_values: torch.Tensor | None  # [num_patches, patch_dim], every image in order
    image_grid_thw: torch.Tensor | None  # [num_images, 3]
    tokens: list[int]  # merged tokens of each image: what its placeholder expands to


def image_token_id(processor: Any) -> int:
    """The `<|image_pad|>` token of `processor`'s model."""
    token = getattr(processor, "image_token_id", None)
    if token is None:
        token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int(token)


def encode_images(processor: Any, images: list[Image.Image]) -> EncodedImages:
    """The pixels and grids of `images` as the processor makes them, and each image's token count."""
    if not images:
        return EncodedImages(None, None, [])
    out = processor.image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    merge = int(getattr(processor.image_processor, "merge_size", 2))
    tokens = [int(g.prod()) // (merge * merge) for g in grid]
    return EncodedImages(out["pixel_values"], grid, tokens)


def expand_placeholders(
    token_ids: list[int], counts: list[int], pad_id: int, start: int = 0
) -> tuple[list[int], int]:
    """`token_ids` with the k-th `pad_id` (counting from image `start`) repeated counts[start + k] times, and the
    index of the next image. More placeholders than `counts` is a ValueError (an image missing)."""
    out: list[int] = []
    image = start
    for token in token_ids:
        if token != pad_id:
            out.append(token)
            continue
        if image >= len(counts):
            raise ValueError(f"{image + 1} image placeholders in the tokens but only {len(counts)} images")
        out.extend([pad_id] * counts[image])
        image += 1
    return out, image


def check_image_count(token_ids: list[int], images: list[Image.Image], pad_id: int) -> None:
    """Placeholders and images in step: as many `<|image_pad|>` tokens as images (ValueError naming both)."""
    placeholders = sum(1 for t in token_ids if t == pad_id)
    if placeholders != len(images):
        raise ValueError(f"the tokens hold {placeholders} image placeholders for {len(images)} images")


def expand_episode(seq: Sequence, counts: list[int], pad_id: int) -> tuple[Sequence, list[int]]:
    """An episode's sequence as the model reads it: each observation placeholder in its completion repeated
    counts[k] times (the k-th image after the prompt), the environment mask, log-probs (NaN) and modalities
    stretched along; and where each original token now sits (to map per-token values back)."""
    ids: list[int] = []
    env: list[bool] = []
    lps: list[float] = []
    mm: list[int] = []
    masked: list[bool] | None = [] if seq.masked is not None else None
    positions: list[int] = []
    env_mask = seq.env_mask or [False] * len(seq.completion_ids)
    image = 0
    for i, token in enumerate(seq.completion_ids):
        positions.append(len(ids))
        is_image = token == pad_id and env_mask[i]
        if is_image and image >= len(counts):
            raise ValueError(f"an episode holds more observation placeholders than its {len(counts)} images")
        repeat = counts[image] if is_image else 1
        image += is_image
        ids += [token] * repeat
        env += [env_mask[i]] * repeat
        lps += [seq.sampling_logprobs[i] if i < len(seq.sampling_logprobs) else float("nan")] * repeat
        mm += [1 if is_image else 0] * repeat
        if masked is not None and seq.masked is not None:
            masked += [seq.masked[i]] * repeat
    if image != len(counts):
        raise ValueError(f"an episode holds {image} observation placeholders for {len(counts)} images")
    expanded = replace(
        seq, completion_ids=ids, sampling_logprobs=lps, env_mask=env, completion_mm=mm, masked=masked
    )
    return expanded, positions
