"""A reward model as the judge (backend `classifier`): a VLM with a sequence-classification score head, in
transformers, returning one number per answer.

The model is the VLM of the checkpoint (`models.loader`) and its `score.weight` head (`models.score_head`): the
final hidden state of the last token, times the head, is the answer's score, squashed by a sigmoid into (0, 1)
unless `squash: none`. What it reads (`input`): the rendered template as the user's turn with the assistant's
turn opened, as a generative judge is asked, or the conversation (the question and images, then the completion
as the assistant's turn), as public reward models are trained. Batches of `batch_size`, padded on the left; a
prompt the processor refuses scores None (counted as a failed judgement), the rest of its batch is scored.

Runs inside a Ray judge actor during training, or in the process of `visionrl eval --judge`.
"""

from __future__ import annotations

import logging
from typing import Any

from visionrl.data.images import ImageBudget
from visionrl.data.prompts import conversation_prompt, user_prompt
from visionrl.models.loader import load_base_model, load_processor
from visionrl.models.score_head import read_score_head
from visionrl.rewards.judge import JudgeRequest, JudgeSpec
from visionrl.rollout.rejects import generate_skipping
from visionrl.types import PromptItem

logger = logging.getLogger(__name__)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _quietly(load: Any, *args: Any) -> Any:
    """`load(*args)` without transformers' load report, which lists the score head as an unexpected key of the
    VLM (it is read apart, by `read_score_head`)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return load(*args)
    finally:
        hf_logging.set_verbosity(level)


class ClassifierJudge:
    """`judge(requests)`: the reward model's score of each request (None for a prompt it refused)."""

    def __init__(self, spec: JudgeSpec, *, device: str | None = None) -> None:
        assert spec.model is not None  # JudgeSpec.check: the classifier backend names its model
        self.spec = spec
        self.device = device or default_device()
        self.processor = load_processor(spec.model, ImageBudget())
        self.processor.tokenizer.padding_side = "left"  # the last position is every row's last token
        self.head = read_score_head(spec.model)
        self.model = _quietly(load_base_model, spec.model, spec.dtype, self.device)
        self.head = self.head.to(self.device, self.model.dtype)

    def prompt(self, request: JudgeRequest) -> PromptItem:
        if self.spec.input == "conversation":
            return conversation_prompt(self.processor, request.question, request.completion, request.images)
        return user_prompt(self.processor, request.text, request.images)

    def judge(self, requests: list[JudgeRequest]) -> list[float | None]:
        size = self.spec.batch_size
        out: list[float | None] = []

        def skip(index: int, err: BaseException) -> None:
            logger.warning("the classifier judge refused a prompt; it scores on_error: %s", err)

        for start in range(0, len(requests), size):
            batch = requests[start : start + size]
            out += generate_skipping(
                lambda b: self.scores([self.prompt(r) for r in b]), batch, (ValueError,), skip
            )
        return out

    def scores(self, prompts: list[PromptItem]) -> list[float | None]:
        """The head's value at each prompt's last token (sigmoid-squashed unless `squash: none`)."""
        import torch

        images = [img for p in prompts for img in p.images] or None
        enc = self.processor(text=[p.text for p in prompts], images=images, return_tensors="pt", padding=True)
        with torch.no_grad():
            hidden = self.model.model(**enc.to(self.device), use_cache=False).last_hidden_state[:, -1]
            value = (hidden @ self.head.T)[:, 0].float()
        if self.spec.squash == "sigmoid":
            value = torch.sigmoid(value)
        return [float(v) for v in value.cpu()]

    def close(self) -> None:
        del self.model
