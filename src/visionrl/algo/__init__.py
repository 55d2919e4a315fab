"""Pure math of GRPO-style RL: group-relative advantages, reward shaping and per-token losses.

Torch tensors in, tensors out: no I/O, no Ray, no config objects, so every formula here is unit-tested
with hand-derived numbers and reused unchanged by the single-process and the distributed learner.

- ``advantages``: group-relative advantages (GRPO, Dr. GRPO) and group statistics.
- ``shaping``: DAPO's soft overlong penalty, added to the rewards before the advantages.
- ``aggregation``: masked means and the named ways per-token values become one loss.
- ``policy_losses``: the surrogate losses ``LOSS_KINDS`` (PPO, GSPO, CISPO, SAPO), with per-token weights.
- ``rollout_correction``: bounded importance weights for the engine-vs-learner mismatch.
- ``losses``: KL estimators, entropy, token log-probs.
"""

from visionrl.algo.advantages import ADVANTAGE_SCALES, group_advantages, group_stats, groups_with_signal
from visionrl.algo.aggregation import AGGREGATIONS, aggregate, masked_mean
from visionrl.algo.losses import KL_KINDS, entropy_from_logits, kl_penalty, token_logprobs
from visionrl.algo.policy_losses import LOSS_KINDS, policy_loss
from visionrl.algo.rollout_correction import CORRECTION_LEVELS, rollout_correction
from visionrl.algo.shaping import overlong_penalty

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "CORRECTION_LEVELS",
    "KL_KINDS",
    "LOSS_KINDS",
    "aggregate",
    "entropy_from_logits",
    "group_advantages",
    "group_stats",
    "groups_with_signal",
    "kl_penalty",
    "masked_mean",
    "overlong_penalty",
    "policy_loss",
    "rollout_correction",
    "token_logprobs",
]
