"""Scoring of answers from any backend, by the same rewards as training, and image ablation.

`score_generations` turns `Generation`s (from a local engine or from HTTP responses) into per-sample
records; `visionrl.eval.report` turns records into the report. `ablate(prompts, seed)` permutes images
across samples: if accuracy stays up without the right image, the model answers from the text alone.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from visionrl.rewards import CombinedReward
from visionrl.types import Generation, PromptItem

logger = logging.getLogger(__name__)


def positive_weight(reward_fn: CombinedReward) -> float:
    """Sum of the positive reward weights: the best total when every reward lies in [0, 1]."""
    total = sum(spec.weight for spec in reward_fn.specs if spec.weight > 0)
    if total <= 0:
        raise ValueError("evaluation needs at least one reward with a positive weight to define 'correct'")
    return total


def score_generations(
    prompts: Sequence[PromptItem], generations: Sequence[Generation], reward_fn: CombinedReward
) -> list[dict[str, Any]]:
    """Per-sample records: id, answer, completion, reward, rewards, correct, num_tokens, latency_ms,
    finish_reason, error.

    `reward` is the weighted total and `rewards` the unweighted components. A sample is `correct` iff
    reward / (sum of positive weights) >= 0.5: with the default single `exact_match` that is an exact
    match; with several rewards, at least half of the attainable reward. Failed samples (error set) are
    not scored: completion and reward are None and correct is False; `summarize` leaves them out.
    """
    if len(prompts) != len(generations):
        raise ValueError(f"got {len(prompts)} prompts but {len(generations)} generations")
    best = positive_weight(reward_fn)
    ok = [i for i, g in enumerate(generations) if g.error is None]
    # The reward record is the data record with the answer the prompt carries (they may differ for
    # hand-built prompts), as in training.
    result = reward_fn.score(
        [generations[i].text or "" for i in ok],
        [{**prompts[i].record, "answer": prompts[i].answer} for i in ok],
    )
    scored = {i: j for j, i in enumerate(ok)}
    records = []
    for i, (prompt, gen) in enumerate(zip(prompts, generations, strict=True)):
        j = scored.get(i)
        reward = None if j is None else result.total[j]
        records.append(
            {
                "id": prompt.sample_id,
                "answer": prompt.answer,
                "completion": gen.text if j is not None else None,
                "reward": reward,
                "rewards": None if j is None else {k: v[j] for k, v in result.per_reward.items()},
                "correct": reward is not None and reward / best >= 0.5,
                "num_tokens": gen.num_tokens,
                "latency_ms": gen.latency_ms,
                "finish_reason": gen.finish_reason,
                "error": gen.error,
            }
        )
    return records


def ablate(prompts: list[PromptItem], seed: int) -> list[PromptItem]:
    """Copies of `prompts` with the images permuted across samples; text, answer and record stay in place.

    Only samples with the same number of images swap (the prompt text has one placeholder per image). Within
    each such group the permutation is a random cycle through all of them (Sattolo's algorithm), so no
    sample keeps its own images; a group of one sample cannot be permuted and keeps its images (warned).
    """
    rng = random.Random(seed)
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if p.images:
            groups.setdefault(len(p.images), []).append(i)
    out = list(prompts)
    for count, members in sorted(groups.items()):
        if len(members) < 2:
            logger.warning("ablate: the only sample with %d image(s) keeps its own images", count)
            continue
        source = list(members)
        for k in range(len(source) - 1, 0, -1):  # Sattolo: j < k makes the permutation a single cycle
            j = rng.randrange(k)
            source[k], source[j] = source[j], source[k]
        for target, src in zip(members, source, strict=True):
            out[target] = replace(
                prompts[target],
                images=list(prompts[src].images),
                source_images=list(prompts[src].source_images),
            )
    return out
