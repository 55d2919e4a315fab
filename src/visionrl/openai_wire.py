"""What goes over the wire to an OpenAI-compatible server: images as data URLs, chat messages with those images
in place of the data's image placeholders, and the base URL. Shared by served evaluation (`eval.endpoint`,
`eval.sagemaker_runtime`) and the endpoint judge (`judge.endpoint`)."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from PIL import Image

from visionrl.types import Generation

# One answer from a served model: (model, chat messages, request options) -> Generation; failures are failed
# Generations, never exceptions (`eval.endpoint.openai_asker`, `eval.sagemaker_runtime.sagemaker_asker`).
Ask = Callable[[str, list[dict[str, Any]], dict[str, Any]], Generation]


def image_data_url(image: Image.Image) -> str:
    """`data:image/png;base64,...` of `image` (PNG: lossless, so the server sees the pixels local eval sees)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def chat_messages(messages: Sequence[dict[str, Any]], images: Sequence[Image.Image]) -> list[dict[str, Any]]:
    """OpenAI chat messages: each `{"type": "image"}` placeholder, in order, becomes the next image as an
    `image_url` part; text parts and roles are kept. The placeholders must match the images one to one."""
    out: list[dict[str, Any]] = []
    used = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        parts = []
        for part in content:
            if part.get("type") != "image":
                parts.append(dict(part))
                continue
            if used == len(images):
                raise ValueError(f"the messages have more image placeholders than the {len(images)} image(s)")
            parts.append({"type": "image_url", "image_url": {"url": image_data_url(images[used])}})
            used += 1
        out.append({"role": message["role"], "content": parts})
    if used != len(images):
        raise ValueError(
            f"the messages have {used} image placeholder(s) but there are {len(images)} image(s)"
        )
    return out


def openai_base_url(endpoint: str) -> str:
    """The OpenAI base URL: `endpoint` as given, or with `/v1` added when it names only a host."""
    endpoint = endpoint.rstrip("/")
    return endpoint + "/v1" if urlsplit(endpoint).path in ("", "/") else endpoint


def completion_generation(response: dict[str, Any], latency_ms: float) -> Generation:
    """A Generation from an OpenAI chat completion (as JSON)."""
    choices = response.get("choices") or []
    if not choices:
        return Generation(None, 0, latency_ms, None, "the endpoint answered without a choice")
    choice = choices[0]
    tokens = (response.get("usage") or {}).get("completion_tokens") or 0
    content = (choice.get("message") or {}).get("content")
    return Generation(content or "", int(tokens), latency_ms, choice.get("finish_reason"))
