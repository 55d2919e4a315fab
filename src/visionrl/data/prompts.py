"""Turn dataset samples into prompts: chat template applied, images kept apart for the engine/learner."""

from __future__ import annotations

from typing import Any

from visionrl.data.dataset import Sample
from visionrl.data.images import fit_to_processor
from visionrl.types import PromptItem


def prompt_messages(sample: Sample, system_prompt: str | None = None) -> list[dict[str, Any]]:
    return with_system_prompt(sample.messages, system_prompt)


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """`messages` with the system message first (when `system_prompt` is set)."""
    messages = list(messages)
    if system_prompt:
        messages = [{"role": "system", "content": [{"type": "text", "text": system_prompt}]}, *messages]
    return messages


def build_prompt(sample: Sample, processor: Any, system_prompt: str | None = None) -> PromptItem:
    """The chat-templated prompt text (one image placeholder per image; processors expand them) and the
    images resized into the processor's pixel bounds (`visionrl.data.images.fit_to_processor`)."""
    text = processor.apply_chat_template(
        prompt_messages(sample, system_prompt), add_generation_prompt=True, tokenize=False
    )
    record = dict(sample.record)
    return PromptItem(
        text=text,
        images=[fit_to_processor(image, processor) for image in sample.images],
        answer=sample.answer,
        record=record,
        sample_id=sample.id,
    )
