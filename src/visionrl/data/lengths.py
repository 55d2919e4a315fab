"""Records that cannot fit the engine, found at load time: too many images, or a prompt too long for the context.

A prompt's length as the engine counts it is its chat-templated text tokens with each image placeholder
expanded to that image's tokens under the image budget (`visionrl.data.images`). The image tokens come from
the image sizes the dataset read from the file headers at load, so no image is decoded here. A record whose
prompt plus `rollout.max_new_tokens` exceeds `rollout.max_model_len` would be rejected by vLLM (or cut short
by it); it is dropped here, counted and listed by id in the run log, instead of failing a batch mid-run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from visionrl.data.dataset import DatasetError, VisionDataset
from visionrl.data.images import ImageBudget, grid_factor, image_tokens
from visionrl.data.prompts import with_system_prompt

logger = logging.getLogger(__name__)

MAX_LISTED_IDS = 100  # ids per log line; the count is always complete


@dataclass
class FitReport:
    """What `fit_to_engine` dropped: record ids with too many images, and with prompts too long."""

    too_many_images: list[str] = field(default_factory=list)
    too_long: list[str] = field(default_factory=list)
    longest_kept: int = 0  # tokens of the longest prompt kept

    @property
    def num_dropped(self) -> int:
        return len(self.too_many_images) + len(self.too_long)


def prompt_lengths(
    dataset: VisionDataset, processor: Any, budget: ImageBudget, system_prompt: str | None = None
) -> list[int]:
    """Tokens of each record's prompt as the learner's processor and the engines encode it (image tokens
    under `budget` included). An image whose size is unknown ((0, 0): not readable at load) counts 0 tokens;
    its record fails when accessed."""
    factor = grid_factor(processor)
    texts = [
        processor.apply_chat_template(
            with_system_prompt(dataset.messages(i), system_prompt), add_generation_prompt=True, tokenize=False
        )
        for i in range(len(dataset))
    ]
    ids = processor.tokenizer(texts)["input_ids"] if texts else []
    lengths = []
    for i, text_ids in enumerate(ids):
        sizes = dataset.image_sizes(i)
        # Each image is one placeholder token in the text; the processor expands it to the image's tokens.
        expanded = sum(image_tokens(w, h, budget, factor) - 1 for w, h in sizes if w and h)
        lengths.append(len(text_ids) + expanded)
    return lengths


def fit_to_engine(
    dataset: VisionDataset,
    processor: Any,
    budget: ImageBudget,
    *,
    max_model_len: int,
    max_new_tokens: int,
    system_prompt: str | None = None,
) -> tuple[VisionDataset, FitReport]:
    """`dataset` without the records over `budget.max_images` images or whose prompt + `max_new_tokens`
    exceeds `max_model_len`; they are added to `dataset.skipped` and listed by id in one warning each.
    Raises DatasetError when no record is left."""
    report = FitReport()
    reasons: dict[int, str] = {}
    lengths = prompt_lengths(dataset, processor, budget, system_prompt)
    limit = max_model_len - max_new_tokens
    for i, (record_id, length) in enumerate(zip(dataset.ids, lengths, strict=True)):
        images = len(dataset.image_sizes(i))
        if images > budget.max_images:
            reasons[i] = f"{images} images, over data.max_images_per_prompt={budget.max_images}"
            report.too_many_images.append(record_id)
        elif length > limit:
            reasons[i] = (
                f"prompt of {length} tokens + rollout.max_new_tokens={max_new_tokens} is over "
                f"rollout.max_model_len={max_model_len}"
            )
            report.too_long.append(record_id)
        else:
            report.longest_kept = max(report.longest_kept, length)
    _warn(dataset.path, report.too_many_images, f"more than data.max_images_per_prompt={budget.max_images} images",
          "raise data.max_images_per_prompt to keep them")  # fmt: skip
    _warn(dataset.path, report.too_long,
          f"a prompt (image tokens included) longer than rollout.max_model_len - rollout.max_new_tokens = {limit} "
          "tokens", "lower data.max_pixels or raise rollout.max_model_len to keep them")  # fmt: skip
    if len(reasons) == len(dataset):
        raise DatasetError(
            f"{dataset.path}: none of its {len(dataset)} records fits the engine (first: {reasons[0]}); "
            "lower data.max_pixels, raise rollout.max_model_len or data.max_images_per_prompt"
        )
    return (dataset.without(set(reasons), reasons) if reasons else dataset), report


def _warn(path: str, ids: list[str], what: str, fix: str) -> None:
    if not ids:
        return
    listed = ", ".join(ids[:MAX_LISTED_IDS])
    more = f" and {len(ids) - MAX_LISTED_IDS} more" if len(ids) > MAX_LISTED_IDS else ""
    logger.warning(
        "%s: dropped %d record(s) with %s (%s); ids: %s%s", path, len(ids), what, fix, listed, more
    )
