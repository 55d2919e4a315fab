"""Evaluation of multi-turn episodes: each held-out prompt played once, greedily, with the job's environment; the
final turn's text is the answer that the rewards score, as a single-turn answer is."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from visionrl.envs.episodes import EpisodeRunner
from visionrl.types import Generation, PromptItem, SamplingSpec


def episode_answers(
    engine: Any,
    prompts: list[PromptItem],
    runner: EpisodeRunner,
    *,
    max_tokens: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[Generation], dict[str, float]]:
    """One greedy episode per prompt (`engine.generate` each turn); the answers (an episode whose environment
    failed is a failed answer) and the episodes' metrics (turns, endings, replay mismatches)."""
    if not prompts:
        return [], {}
    start = clock()
    batch = runner.run(prompts, engine.generate, SamplingSpec(n=1, greedy=True, max_tokens=max_tokens))
    per_sample_ms = (clock() - start) * 1000.0 / len(prompts)
    answers = []
    for group, failed in zip(batch.completions, batch.failed, strict=True):
        c = group[0]
        info = c.episode or {}
        if failed[0]:
            answers.append(
                Generation(
                    None, 0, per_sample_ms, None, f"the environment's episode ended: {info.get('ended')}"
                )
            )
            continue
        sampled = len(c.token_ids) - sum(c.env_mask or [])
        answers.append(Generation(c.text, sampled, per_sample_ms, c.finish_reason))
    return answers, batch.metrics
