"""Runs that train on nothing must not look like runs that trained: the loop's watch over skipped updates and
failing rewards.

A step is *unusable* when every learner update of it was skipped (a non-finite loss or gradient, see
`Learner._apply`) or when a reward function failed on every sample of it (all its scores are the 0 of a failed
call, so the advantages carry no signal). `train.max_consecutive_skips` unusable steps in a row stop the run; a
run that ends without a single applied update, or whose rewards failed on every sample it drew, ends with an
error too. Either way the message shows the first errors, so the cause is on the screen, not only in a counter.
"""

from __future__ import annotations

import logging
from typing import Any

from visionrl import metrics as tags
from visionrl.errors import RunError
from visionrl.rewards import RewardResult

logger = logging.getLogger(__name__)

MAX_ERRORS_SHOWN = 3


def failed_rewards(scores: RewardResult) -> list[str]:
    """Reward components that failed (raised, returned a non-number, or timed out) on every sample."""
    n = len(scores.total)
    keys = set(scores.num_errors) | set(scores.num_timeouts)
    return sorted(
        k for k in keys if n > 0 and scores.num_errors.get(k, 0) + scores.num_timeouts.get(k, 0) >= n
    )


class RunHealth:
    """Counts unusable steps (see the module docstring) and raises RunError when the run is training on nothing."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = max_consecutive
        self.in_a_row = 0
        self.steps = 0
        self.updates_applied = 0
        self.updates_skipped = 0
        self.reward_failed_steps = 0
        self.errors: list[str] = []  # the first few causes, shown when the run stops

    def after_step(self, step: int, stats: dict[str, Any], scores: RewardResult) -> None:
        """Record one step's learner stats (empty: no update was tried) and reward scores; raise at the limit."""
        self.steps += 1
        problems = []
        tried = int(stats.get("updates", 0))
        skipped = int(stats.get(tags.SKIPPED_UPDATES, 0))
        self.updates_applied += tried - skipped
        self.updates_skipped += skipped
        if tried and skipped >= tried:
            problems.append(
                f"step {step}: all {tried} learner update(s) skipped: loss {stats.get(tags.LOSS_TOTAL)}, gradient "
                f"norm {stats.get(tags.GRAD_NORM)}"
            )
        failed = failed_rewards(scores)
        if failed:
            self.reward_failed_steps += 1
        for key in failed:
            example = scores.error_examples.get(key, "timed out")
            problems.append(
                f"step {step}: reward {key!r} failed on all {len(scores.total)} samples: {example}"
            )
        if not problems:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        for p in problems:
            logger.warning("%s", p)
            if len(self.errors) < MAX_ERRORS_SHOWN:
                self.errors.append(p)
        if self.in_a_row >= self.max_consecutive:
            raise RunError(
                f"{self.in_a_row} steps in a row without a usable update (train.max_consecutive_skips="
                f"{self.max_consecutive}); the run is training on nothing. First errors:\n"
                + self._shown()
                + "\nThe checkpoints hold the adapter of the last applied update."
            )

    def finish(self) -> None:
        """At the end of the run: raise if no update was ever applied, or if rewards failed on every step."""
        if self.updates_skipped and not self.updates_applied:
            raise RunError(
                f"every learner update of the run ({self.updates_skipped}) was skipped as non-finite; the "
                "adapter is untrained, so none is exported. First errors:\n" + self._shown()
            )
        if self.steps and self.reward_failed_steps == self.steps:
            raise RunError(
                f"a reward failed on every sample of all {self.steps} steps: the run trained on no signal, so no "
                "adapter is exported. First errors:\n" + self._shown()
            )

    def _shown(self) -> str:
        return "\n".join(f"  - {e}" for e in self.errors)


ENTROPY_FLOOR = 0.05  # mean policy entropy per token (nats) below which sampling barely explores
SIGNAL_FLOOR = 0.05  # share of groups with any reward difference below which the updates carry almost nothing
COLLAPSE_STEPS = 3  # steps in a row under both floors before the warning


class CollapseWatch:
    """Warns (once) when the policy has collapsed before reaching the target: for COLLAPSE_STEPS steps in a row its
    entropy is under ENTROPY_FLOOR and under SIGNAL_FLOOR of the groups have any reward difference, while the
    latest held-out accuracy is below `train.target_accuracy` (or there is no target or no evaluation yet). Every
    group's samples then agree, the group-relative advantages are zero and learning stops where it is; the message
    names the settings that keep a policy exploring, with values to try."""

    def __init__(self, algo: Any, target: float | None) -> None:
        self.algo, self.target = algo, target
        self.in_a_row, self.warned = 0, False

    def after_step(self, step: int, m: dict[str, Any], accuracy: float | None) -> bool:
        """Record one step's metrics and the latest held-out accuracy; True when it warned this step."""
        entropy, signal = m.get(tags.ENTROPY), m.get(tags.GROUPS_WITH_SIGNAL)
        if entropy is None or signal is None:
            return False
        reached = accuracy is not None and self.target is not None and accuracy >= self.target
        collapsed = entropy < ENTROPY_FLOOR and signal < SIGNAL_FLOOR and not reached
        self.in_a_row = self.in_a_row + 1 if collapsed else 0
        if self.warned or self.in_a_row < COLLAPSE_STEPS:
            return False
        self.warned = True
        acc = "not evaluated yet" if accuracy is None else f"{accuracy:.3f}"
        target = "" if self.target is None else f" (target {self.target})"
        logger.warning(
            "step %d: the policy has collapsed: entropy %.3g nats per token and %.0f%% of groups with any reward "
            "difference for %d steps in a row, held-out accuracy %s%s. Every group's samples agree, so the "
            "advantages are zero and learning has stopped. Keep it exploring: %s",
            step,
            entropy,
            100 * signal,
            self.in_a_row,
            acc,
            target,
            "; ".join(self.remedies()),
        )
        return True

    def remedies(self) -> list[str]:
        """The exploration settings, each with its value now and one to try (DAPO's, an entropy bonus, a KL to the
        base model, and more updates per batch, without which clip-higher cannot act when the learner's log-probs
        are the old policy: the one mini-batch is on-policy, its ratio exactly 1)."""
        a = self.algo
        on_policy = a.updates_per_batch == 1 and a.old_logprobs == "learner"
        clip_note = "; it acts only with updates_per_batch >= 2" if on_policy else ""
        return [
            f"algorithm.clip_high (now {a.clip_high}; DAPO clip-higher: {max(0.28, a.clip_high + 0.08):.2f}"
            f"{clip_note})",
            f"algorithm.dynamic_sampling (now {str(a.dynamic_sampling).lower()}; try true)",
            f"algorithm.entropy_coef (now {a.entropy_coef}; try {max(0.01, 2 * a.entropy_coef):g})",
            f"algorithm.kl_coef (now {a.kl_coef}; try {max(0.1, 2 * a.kl_coef):g}: a KL to the base model pulls a "
            "collapsed answer back toward the base's own spread, where groups disagree again)",
            f"algorithm.updates_per_batch (now {a.updates_per_batch}; try {2 * a.updates_per_batch}: more updates "
            "from each batch)",
        ]
