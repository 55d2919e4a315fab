"""The prompt stream: the loop's data side. Loads the training and held-out data once (with the model's
processor, before Ray starts, so a bad path fails in seconds), and hands out chat-templated prompts: the
step's batch (resumable through its sampler), the few prompts of the start-up adapter probe, and the
held-out prompts of evaluation.
"""

from __future__ import annotations

from typing import Any

from visionrl import metrics as tags
from visionrl.config import JobConfig
from visionrl.data import PromptSampler, VisionDataset, load_dataset
from visionrl.data.images import ImageBudget
from visionrl.data.layouts import Layout
from visionrl.data.lengths import fit_to_engine
from visionrl.data.prompts import build_prompt
from visionrl.data.sampler import draw_samples
from visionrl.models.loader import load_processor
from visionrl.types import PromptItem


class PromptStream:
    """Batches of chat-templated prompts from the training data, resumable; and the held-out prompts.

    Records the engines could not take (more images than data.max_images_per_prompt, or a prompt that with
    rollout.max_new_tokens exceeds rollout.max_model_len) are dropped at load and listed in the log
    (`visionrl.data.lengths`)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.processor = load_processor(cfg.model.path, ImageBudget.of(cfg.data))
        d = cfg.data
        layout = Layout.of(d)
        self.train = self._fit(load_dataset(d.train, on_bad_image=d.on_bad_image, layout=layout))
        self.sampler = PromptSampler(
            self.train, cfg.rollout.prompts_per_step, cfg.train.seed, balance_key=d.balance_key
        )
        self._eval_data = None
        if d.eval is not None:
            self._eval_data = self._fit(
                load_dataset(
                    d.eval, on_bad_image=d.on_bad_image, max_samples=d.max_eval_samples, layout=layout
                )
            )
        self._eval: list[PromptItem] | None = None

    def _fit(self, dataset: VisionDataset) -> VisionDataset:
        cfg = self.cfg
        fitted, _ = fit_to_engine(
            dataset,
            self.processor,
            ImageBudget.of(cfg.data),
            max_model_len=cfg.rollout.max_model_len,
            max_new_tokens=cfg.rollout.max_new_tokens,
            system_prompt=cfg.data.system_prompt,
        )
        return fitted

    def next_batch(self) -> list[PromptItem]:
        return [self._prompt(s) for s in draw_samples(self.train, self.sampler)]

    def data_metrics(self) -> dict[str, float]:
        """Records skipped for bad images: at load, and mid-run so far (each replaced by another record)."""
        return {
            tags.DATA_SKIPPED_AT_LOAD: float(self.train.num_skipped),
            tags.DATA_SKIPPED_MIDRUN: float(len(self.sampler.excluded)),
        }

    def _prompt(self, sample: Any) -> PromptItem:
        return build_prompt(
            sample, self.processor, self.cfg.data.system_prompt, keep_source=self.cfg.env is not None
        )

    def probe_prompts(self, n: int = 4) -> list[PromptItem]:
        """A few training prompts for the start-up adapter probe; the sampler's position is not touched."""
        return [self._prompt(self.train[i]) for i in range(min(n, len(self.train)))]

    def eval_prompts(self) -> list[PromptItem]:
        if self._eval_data is None:
            return []
        if self._eval is None:
            self._eval = [self._prompt(s) for s in self._eval_data]
        return self._eval
