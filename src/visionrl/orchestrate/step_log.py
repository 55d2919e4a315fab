"""What a step writes besides its checkpoint: the rollouts shown as pictures in TensorBoard (the first
completion of the first groups, with question, answer and reward; `visionrl.pictures` draws them)."""

from __future__ import annotations

import json
from typing import Any

from visionrl.pictures import RolloutSample
from visionrl.types import Completion, PromptItem


def rollout_samples(
    prompts: list[PromptItem], completions: list[list[Completion]], totals: list[float], n: int
) -> list[RolloutSample]:
    """A few rollouts (the first completion of the first `n` groups) for the TensorBoard picture grid."""
    out = []
    G = len(completions[0]) if completions else 1
    for i, (p, group) in enumerate(zip(prompts[:n], completions[:n], strict=False)):
        if not p.images:
            continue
        question = _question_text(p.record)
        out.append(
            RolloutSample(
                image=p.images[0],
                question=question,
                completion=group[0].text,
                answer=json.dumps(p.answer) if not isinstance(p.answer, str) else p.answer,
                reward=float(totals[i * G]),
            )
        )
    return out


def _question_text(record: dict[str, Any]) -> str:
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    texts = []
    for msg in record.get("messages", []):
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            texts.extend(part.get("text", "") for part in content or [] if part.get("type") == "text")
    return " ".join(t for t in texts if t)
