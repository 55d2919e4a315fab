"""`algorithm.correction_mode: mask`: the tokens the rollout correction leaves out, decided before the update.

A masked token leaves the loss and its normalisers (the `token_mean` denominator counts only the tokens that
train, as for a token the engine gave no log-prob for), so the mask must be known before the first
micro-batch's loss: from the learner's log-probs before the update (the old policy, one no-grad pass over this
rank's rows, mini-batch 1 included) against the engine's sampling log-probs. Masking with the engine's
log-probs as the old policy would compare them with themselves (every weight 1): nothing is masked then.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from visionrl.algo import rollout_correction
from visionrl.config import AlgorithmConfig
from visionrl.models.sequences import Sequence
from visionrl.train.ranks import RankGroup


def masks_before_update(algo: AlgorithmConfig) -> bool:
    return (
        algo.rollout_correction != "off" and algo.correction_mode == "mask" and algo.old_logprobs == "learner"
    )


def with_correction_masks(
    seqs: list[Sequence], rows: list[int], old: dict[int, torch.Tensor], algo: AlgorithmConfig
) -> tuple[list[Sequence], torch.Tensor]:
    """`seqs` with `masked` set on `rows` (old log-probs in `old`), and [tokens masked, tokens scored before]
    over those rows (float64, for the ranks to sum)."""
    out, counts = list(seqs), torch.zeros(2, dtype=torch.float64)
    for r in rows:
        seq, k = seqs[r], len(seqs[r].completion_ids)
        if not k:
            continue
        keep = seq.scored()
        engine = torch.tensor(seq.sampling_logprobs[:k], dtype=torch.float32).nan_to_num(0.0)
        weights, _ = rollout_correction(
            old[r][:k].float().unsqueeze(0),
            engine.unsqueeze(0),
            keep.float().unsqueeze(0),
            level=algo.rollout_correction,
            threshold=algo.correction_threshold,
            lower=algo.correction_lower,
        )
        masked = keep & (weights[0] == 0)  # a kept weight is exp(bounded log-ratio) > 0
        out[r] = replace(seq, masked=masked.tolist())
        counts += torch.tensor([float(masked.sum()), float(keep.sum())], dtype=torch.float64)
    return out, counts


def loss_tokens(
    seqs: list[Sequence], rows: list[int], mine: list[int], masking: bool, ranks: RankGroup
) -> float:
    """The `token_mean` normaliser of the mini-batch `rows`: its tokens in the loss. Every rank counts them
    all, except with `masking`, where each knows the masks of its own rows (`mine`) only: summed over the ranks."""
    if not masking:
        return float(sum(int(seqs[r].scored().sum()) for r in rows))
    local = torch.tensor([float(sum(int(seqs[r].scored().sum()) for r in mine))], dtype=torch.float64)
    return float(ranks.sum_(local)[0])
