"""Turn dataset samples into prompts: chat template applied, images kept apart for the engine/learner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

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


def build_prompt(
    sample: Sample, processor: Any, system_prompt: str | None = None, keep_source: bool = False
) -> PromptItem:
    """The chat-templated prompt text (one image placeholder per image; processors expand them) and the
    images resized into the processor's pixel bounds (`visionrl.data.images.fit_to_processor`); with
    `keep_source` the images as loaded too (an environment crops them: `PromptItem.source_images`)."""
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
        source_images=list(sample.images) if keep_source else [],
    )


def user_prompt(processor: Any, text: str, images: Sequence[Image.Image]) -> PromptItem:
    """One user message (the images, then `text`) chat-templated for `processor`'s model, its images fitted into
    the processor's pixel bounds: how a judge model is asked."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    templated = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return PromptItem(text=templated, images=[fit_to_processor(image, processor) for image in images])


def conversation_prompt(
    processor: Any, question: str, answer: str, images: Sequence[Image.Image]
) -> PromptItem:
    """A user turn (the images, then `question`) and the assistant's `answer`, chat-templated for `processor`'s
    model, closed (no turn opened after it): what a reward model that reads the conversation scores."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    messages = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    templated = processor.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    return PromptItem(text=templated, images=[fit_to_processor(image, processor) for image in images])


def question_text(record: dict[str, Any], prompt_key: str = "prompt") -> str:
    """The question a record asks: its `prompt_key` field (image markers removed), else its messages' text."""
    if isinstance(record.get(prompt_key), str):
        return str(record[prompt_key]).replace("<image>", "").strip()
    texts = []
    for msg in record.get("messages", []):
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            texts.extend(part.get("text", "") for part in content or [] if part.get("type") == "text")
    return " ".join(t for t in texts if t)
