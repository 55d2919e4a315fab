"""Pure math of GRPO-style RL: group-relative advantages and per-token losses.

Torch tensors in, tensors out: no I/O, no Ray, no config objects, so every formula here is unit-tested
with hand-derived numbers and reused unchanged by the single-process and the distributed learner.
"""

from visionrl.algo.advantages import ADVANTAGE_SCALES, group_advantages, group_stats, groups_with_signal
from visionrl.algo.losses import (
    AGGREGATIONS,
    KL_KINDS,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    masked_mean,
    policy_loss,
    token_logprobs,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL_KINDS",
    "aggregate",
    "entropy_from_logits",
    "group_advantages",
    "group_stats",
    "groups_with_signal",
    "kl_penalty",
    "masked_mean",
    "policy_loss",
    "token_logprobs",
]
