"""The checks that the engines sample the policy being trained, and what they say when one fails.

Three checks, each comparing the engine with the learner on the same tokens under the same adapter:
- **The probe** (at start-up, after an engine restart and after an engine rebuilt itself): once per adapter
  part (`train.probe`), a random adapter on that part alone must move the engine's greedy output, and the
  learner, with the same weights, must compute the engine's log-probs of the tokens it generated to within
  `rollout.max_logprob_diff`. A part the engine skips does not move it; a wrong scale or slice moves it but
  disagrees.
- **The fingerprint** (after every sync, so also after every wake from sleep): each engine's log-probs of one
  fixed prompt's continuation under the version just synced, against the learner's, which holds that version.
  The first check (at start-up) takes each engine's greedy completion and has the learner score it; its tokens
  then stay the continuation (`FingerprintPrompt`, a greedy check again every `REFRESH_CHECKS` syncs): later
  checks teacher-force them, so an engine scores them in one prefill and the learner scores them while the engines
  load the version, not after. Those log-probs are raw on both sides (over the whole vocabulary: vLLM's prompt
  log-probs skip its sampling processors). It names the engine; `rollout.max_logprob_diff_steps` syncs in a row
  over the bound stop the run.
- **The rollout mismatch** (`rollout/logprob_diff`, every update): the learner's log-probs of the sampled
  tokens under the version that sampled them against the engine's.
Fingerprint and rollout mismatch are bounded twice (`DiffWatch`): by `rollout.max_logprob_diff` and, once the
run has `EARLY_STEPS` values, by `rollout.max_logprob_diff_ratio` times their median (never below
`RELATIVE_FLOOR`), so a drift from the run's own level is caught below the absolute bound.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass

from visionrl.errors import RunError
from visionrl.models.sequences import Sequence
from visionrl.train.learner import TrainBatch
from visionrl.train.probe import MERGER
from visionrl.types import Completion, ProbeResult, PromptItem

logger = logging.getLogger(__name__)
PROBE_MIN_CHANGE = 1e-4  # a non-zero adapter moves a greedy log-prob by far more; 0 means it was not applied
EARLY_STEPS = 5  # the values whose median the relative bound is a multiple of
# nats: the relative bound never goes below (float32 runs sit near 1e-6, noise included)
RELATIVE_FLOOR = 0.01
FINGERPRINT_TOKENS = 8  # greedy tokens of the fingerprint prompt
# teacher-forced fingerprints between two greedy ones (each greedy check costs about 0.16 s more at 8B on an H100:
# 0.008 s a sync spread over these)
REFRESH_CHECKS = 20
# engine-learner gap allowed, as a share of the probe's effect (bf16 noise measured 0.02-0.04 nats against an
# effect of 3.6-4.3 on an H100 at 8B shape)
PROBE_AGREEMENT = 0.25

LIKELY_CAUSES = {
    "language model": "LoRA targets the engine does not wrap (lora.target_modules), or lora.rank above the "
    "engine's max_lora_rank",
    MERGER: "LoRA on the merger without vLLM's tower-connector LoRA (lora.train_merger must be set for the "
    "engine to enable it), or a vLLM build that skips LoRA on the vision tower",
}
DISAGREE_CAUSES = (
    "the engine applies the adapter differently from the learner: a LoRA scale (lora.alpha / lora.rank) read "
    "differently, the wrong slices of a fused projection, or a dtype or kernel far from the learner's"
)


def scoring_batch(
    prompts: list[PromptItem], per_engine: list[list[list[Completion]]]
) -> tuple[TrainBatch, list[int]]:
    """Every engine's first completion of each prompt as a sequence for the learner to score, and the engine
    of each sequence (prompts an engine rejected are left out)."""
    seqs, owners = [], []
    for engine, groups in enumerate(per_engine):
        for i, g in enumerate(groups):
            if g and g[0].token_ids:
                c = g[0]
                seqs.append(
                    Sequence(
                        prompt=i, completion_ids=c.token_ids, advantage=0.0, sampling_logprobs=c.logprobs
                    )
                )
                owners.append(engine)
    return TrainBatch(prompts=prompts, sequences=seqs), owners


@dataclass
class FingerprintPrompt:
    """The fingerprint's prompt and the continuation the checks teacher-force: the first non-empty greedy
    completion of a greedy check, the first one at start-up. Every REFRESH_CHECKS teacher-forced checks the next one
    is greedy again and fixes a new continuation: the policy moves away from tokens it chose long ago, and the
    log-probs of tokens it no longer favours would drift from the run's early level that the relative bound holds."""

    prompt: PromptItem
    continuation: list[int] | None = None
    forced: int = 0  # teacher-forced checks since the continuation was fixed

    def fix(self, got: list[Completion | None]) -> None:
        """The first engine's completion with tokens becomes the continuation (none with tokens: kept as it was)."""
        first = next((c for c in got if c is not None and c.token_ids), None)
        if first is not None:
            self.continuation, self.forced = list(first.token_ids), 0

    def forced_batch(self) -> TrainBatch | None:
        """The continuation as one sequence for the learner to score, counted as one teacher-forced check; None
        when the next check is greedy (nothing fixed yet, or REFRESH_CHECKS teacher-forced since the last fix)."""
        if self.continuation is None or self.forced >= REFRESH_CHECKS:
            return None
        self.forced += 1
        k = len(self.continuation)
        seq = Sequence(prompt=0, completion_ids=self.continuation, advantage=0.0, sampling_logprobs=[0.0] * k)
        return TrainBatch(prompts=[self.prompt], sequences=[seq])


def diffs_by_engine(
    owners: list[int], rows: list[list[float]], others: list[list[float]], engines: int
) -> list[float]:
    """Mean |row - other| per token of each engine's sequences (0 for an engine without any), over the tokens
    whose `rows` value is finite (a token without an engine log-prob has nothing to compare). Engine against
    learner: `rows` the engine's log-probs; the probe's effect: the learner's under the probe against its own."""
    sums, counts = [0.0] * engines, [0] * engines
    for owner, row, other in zip(owners, rows, others, strict=True):
        for x, y in zip(row, other, strict=False):
            if math.isfinite(x):
                sums[owner] += abs(x - y)
                counts[owner] += 1
    return [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]


@dataclass(frozen=True)
class PartProbe:
    """One engine's probe of one adapter part."""

    engine: int
    part: str
    result: ProbeResult
    diff: float  # mean |engine - learner| log-prob of the engine's greedy tokens under the probe adapter
    effect: float  # the learner's mean |log-prob change| of those tokens from its own weights to the probe's

    @property
    def moved(self) -> bool:
        return self.result.tokens_changed > 0 or self.result.largest_change >= PROBE_MIN_CHANGE

    def agrees(self, bound: float) -> bool:
        """Within `bound`, and well inside the probe's own effect: an engine that skips the part or scales it
        wrongly is off by about the effect itself (`PROBE_AGREEMENT`)."""
        return self.diff <= bound and (
            self.diff <= PROBE_AGREEMENT * self.effect or self.diff <= RELATIVE_FLOOR
        )

    def describe(self) -> str:
        r = self.result
        return (
            f"engine {self.engine}, {self.part}: first greedy token changed on {r.tokens_changed} of "
            f"{len(r.completions)} prompts, largest log-prob change of the others {r.largest_change:.3g}, "
            f"|engine - learner| {self.diff:.3g} nats per token (the probe's effect {self.effect:.3g})"
        )


def check_probes(probes: list[PartProbe], bound: float, when: str) -> None:
    """Raise RunError naming every engine and part that the probe adapter did not move, or that disagreed with
    the learner by more than `bound` (`when`: at start-up, after a restart, ...)."""
    still = [p for p in probes if not p.moved]
    apart = [p for p in probes if p.moved and not p.agrees(bound)]
    if not still and not apart:
        return
    lines = []
    for p in still:
        lines.append(
            f"- {p.describe()}: the engine ignores the {p.part} LoRA. Likely causes: {LIKELY_CAUSES[p.part]}"
        )
    for p in apart:
        lines.append(
            f"- {p.describe()}: over rollout.max_logprob_diff={bound:g}. Likely causes: {DISAGREE_CAUSES}"
        )
    engines = sorted({p.engine for p in still + apart})
    raise RunError(
        f"rollout engine(s) {engines} do not apply the LoRA adapter as the learner does ({when}): a random "
        "adapter on one part at a time was sent to the engines and scored by the learner.\n"
        + "\n".join(lines)
        + "\nRollouts would not sample the policy being trained, so the run stops."
    )


class DiffWatch:
    """Consecutive values over the bound: `limit`, and (once `EARLY_STEPS` values are in, with `ratio` set)
    `ratio` times their median, never below `RELATIVE_FLOOR`. Values over the bound stay out of the median."""

    def __init__(self, limit: float, ratio: float | None) -> None:
        self.limit, self.ratio = limit, ratio
        self.early: list[float] = []
        self.over = 0

    def bound(self) -> float:
        if self.ratio is None or len(self.early) < EARLY_STEPS:
            return self.limit
        return min(self.limit, max(self.ratio * statistics.median(self.early), RELATIVE_FLOOR))

    def describe_bound(self) -> str:
        if self.bound() < self.limit:
            return (
                f"{self.bound():.3g} (rollout.max_logprob_diff_ratio={self.ratio:g} x this run's median "
                f"{statistics.median(self.early):.3g} of its first {EARLY_STEPS} values)"
            )
        return f"rollout.max_logprob_diff={self.limit:g}"

    def add(self, value: float) -> bool:
        """Record `value`; True when it is over the bound."""
        over = value > self.bound()
        if not over and len(self.early) < EARLY_STEPS:
            self.early.append(value)
        self.over = self.over + 1 if over else 0
        return over


class MismatchWatch:
    """Stops a run whose engines do not sample the policy being trained: the mean |engine - learner| log-prob
    of the sampled tokens under the version that sampled them over the bound for `steps` steps in a row."""

    def __init__(self, limit: float, steps: int, ratio: float | None = None) -> None:
        self.watch, self.steps = DiffWatch(limit, ratio), steps

    def check(self, step: int, diff: float | None) -> None:
        if diff is None or not self.watch.add(diff):
            return
        what = (
            f"step {step}: the engine's sampling log-probs differ from the learner's by {diff:.3g} per token "
            f"(mean |difference|, same tokens and adapter version), over {self.watch.describe_bound()}"
        )
        if self.watch.over < self.steps:
            logger.warning("%s (%d of %d steps in a row allowed)", what, self.watch.over, self.steps)
            return
        raise RunError(
            f"{what} for {self.watch.over} steps in a row: the engines are not sampling the policy being trained, "
            "so the updates are off-policy by an unknown amount. Likely causes: adapter syncs that do not reach "
            "the engine (look for LoRA warnings in the engine log), an engine dtype or kernel far from the "
            "learner's, or sampling settings that differ (temperature). If the gap is expected, raise "
            "rollout.max_logprob_diff"
        )


class FingerprintWatch:
    """Per engine: its fingerprint after each sync against the learner's, over the bound for `steps` syncs in a
    row stops the run, naming the engine."""

    def __init__(self, engines: int, limit: float, steps: int, ratio: float | None = None) -> None:
        self.watches = [DiffWatch(limit, ratio) for _ in range(engines)]
        self.steps = steps

    def check(self, step: int, version: int, diffs: list[float]) -> None:
        for engine, (watch, diff) in enumerate(zip(self.watches, diffs, strict=True)):
            if not watch.add(diff):
                continue
            what = (
                f"step {step}: rollout engine {engine} scores the fingerprint prompt under adapter version "
                f"{version} {diff:.3g} nats per token away from the learner, over {watch.describe_bound()}"
            )
            if watch.over < self.steps:
                logger.warning("%s (%d of %d syncs in a row allowed)", what, watch.over, self.steps)
                continue
            raise RunError(
                f"{what}, {watch.over} syncs in a row: rollout engine {engine} does not serve the adapter the "
                "learner sent it, so its rollouts are not from the policy being trained. Likely causes: an adapter "
                "sync that did not reach the engine (look for LoRA warnings in its log), an engine that lost its "
                "adapter when it woke or was rebuilt, or an engine dtype or kernel far from the learner's"
            )
