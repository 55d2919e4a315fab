"""The image budget: how large an image the model sees and how many images a prompt may hold.

Qwen-VL processors resize every image, keeping its aspect ratio, to sides that are multiples of the patch
grid (`patch_size * merge_size` pixels) with a pixel count inside [min_pixels, max_pixels]; each
`factor x factor` cell then becomes one image token. Without a budget a 4032x3024 photo is about 11,800
tokens, more than a 4096-token context. `ImageBudget` carries `data.min_pixels` / `data.max_pixels` /
`data.max_images_per_prompt` to every place that turns images into tokens: the learner's and the HF
engine's processor (`processor_size`), vLLM (`vllm_processor_kwargs`, `vllm_mm_limit`) and the served model
(the same two, from the adapter manifest). Prompts carry their images already resized to the budget size
(`fit_image`, by `visionrl.data.prompts.build_prompt` and the endpoint client), so the learner, the engines
and a server all get the same pixels, whose size their processors keep, and a request never carries a full
photo. Sizes are computed with the processor's own rule (transformers' `smart_resize`, which vLLM uses too:
docs/ENGINE_NOTES.md), so the token count of a record is known from its image sizes alone, before any image
is decoded (`image_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from PIL import Image

# 32 x 32: a small image keeps about its size (1 token at Qwen3-VL's 32-pixel grid) instead of being enlarged.
DEFAULT_MIN_PIXELS = 32 * 32
# 1024 x 1024: at most 1,024 image tokens at Qwen3-VL's 32-pixel grid (1,337 at Qwen2.5-VL's 28), a quarter
# of a 4096-token context; Qwen3-VL's own processor allows 16.7 M pixels (16,384 tokens).
DEFAULT_MAX_PIXELS = 1024 * 1024
DEFAULT_MAX_IMAGES = 4  # images per prompt


@dataclass(frozen=True)
class ImageBudget:
    """Pixel bounds of every image and the most images one prompt may hold."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES

    def __post_init__(self) -> None:
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(
                f"min_pixels={self.min_pixels} and max_pixels={self.max_pixels} must satisfy "
                "1 <= min_pixels <= max_pixels"
            )
        if self.max_images < 1:
            raise ValueError(f"max_images must be >= 1, got {self.max_images}")

    @classmethod
    def of(cls, data: Any) -> ImageBudget:
        """The budget of a job's `data` section (`visionrl.config.DataConfig`)."""
        return cls(data.min_pixels, data.max_pixels, data.max_images_per_prompt)

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> ImageBudget:
        """The budget recorded by `as_dict` (the adapter manifest's `images`)."""
        return cls(
            int(settings["min_pixels"]), int(settings["max_pixels"]), int(settings["max_images_per_prompt"])
        )

    def as_dict(self) -> dict[str, int]:
        return {
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "max_images_per_prompt": self.max_images,
        }

    def processor_size(self) -> dict[str, int]:
        """The Qwen-VL image processor's `size` (transformers 5 keeps the pixel bounds there)."""
        return {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}

    def vllm_processor_kwargs(self) -> dict[str, Any]:
        """vLLM's `mm_processor_kwargs` (server: `--mm-processor-kwargs`): the same bounds for its processor."""
        return {"size": self.processor_size()}

    def vllm_mm_limit(self) -> dict[str, int]:
        """vLLM's `limit_mm_per_prompt` (server: `--limit-mm-per-prompt`); videos are not used."""
        return {"image": self.max_images, "video": 0}


def grid_factor(processor: Any) -> int:
    """Side in pixels of the cell that becomes one image token: `patch_size * merge_size` of the processor."""
    image_processor = getattr(processor, "image_processor", processor)
    return int(image_processor.patch_size) * int(image_processor.merge_size)


def budget_size(width: int, height: int, budget: ImageBudget, factor: int) -> tuple[int, int]:
    """(width, height) the processor resizes a `width x height` image to under `budget`: sides multiples of
    `factor`, aspect ratio kept, pixel count in [min_pixels, max_pixels]. Raises ValueError for an aspect
    ratio over 200 (the processor refuses those too)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    h, w = smart_resize(
        height, width, factor=factor, min_pixels=budget.min_pixels, max_pixels=budget.max_pixels
    )
    return int(w), int(h)


def image_tokens(width: int, height: int, budget: ImageBudget, factor: int) -> int:
    """Image tokens of one `width x height` image under `budget`: one per `factor x factor` cell."""
    w, h = budget_size(width, height, budget, factor)
    return (w // factor) * (h // factor)


def fit_image(image: Image.Image, budget: ImageBudget, factor: int) -> Image.Image:
    """`image` resized (bicubic, as the processor) to its budget size; the same image when it already has it.

    A processor given the result keeps its size, so a server sees exactly the token count a local run sees,
    and the request carries at most `max_pixels` pixels instead of the original photo.
    """
    size = budget_size(image.width, image.height, budget, factor)
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def fit_to_processor(image: Image.Image, processor: Any) -> Image.Image:
    """`fit_image` with the pixel bounds and grid of `processor` (one loaded with a budget: `load_processor`)."""
    size = getattr(processor, "image_processor", processor).size
    budget = ImageBudget(int(size["shortest_edge"]), int(size["longest_edge"]))
    return fit_image(image, budget, grid_factor(processor))
