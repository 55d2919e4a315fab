"""The evaluation report: headline numbers over per-sample records, written as JSON with a Markdown twin.

Shared by every way of producing answers (local engines, a served endpoint, the training loop's periodic
eval), so their reports have one format. Both files are written atomically: a reader never sees half a
report, even if we are killed. `EvalSettings` holds what both evaluators (`visionrl.eval.local`,
`visionrl.eval.endpoint`) are asked and record; its `report` times the answers, scores them and writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from visionrl.errors import InputError, storage_errors
from visionrl.eval.scoring import ablate, score_generations
from visionrl.files import atomic_write
from visionrl.rewards import CombinedReward, RewardSpec, build_reward_fn
from visionrl.types import Generation, PromptItem

MARKDOWN_SAMPLES = 10  # samples shown in the Markdown twin (all of them are in the JSON)


def nearest_rank(values: Sequence[float], percent: int) -> float | None:
    """The `percent`-th percentile by nearest rank: the ceil(percent/100 * n)-th smallest value (None if empty)."""
    if not 0 < percent <= 100:
        raise ValueError(f"percent must be in (0, 100], got {percent}")
    if not values:
        return None
    ordered = sorted(values)
    # percent * n is an exact integer, so the division is exact when the rank is whole (no 18.999... rounding).
    return ordered[max(1, math.ceil(percent * len(ordered) / 100)) - 1]


def accuracy(records: list[dict[str, Any]]) -> float:
    """Correct answers over the samples that did not fail (an error, not a wrong answer); 0.0 if all failed."""
    done = [r for r in records if r["error"] is None]
    return sum(bool(r["correct"]) for r in done) / len(done) if done else 0.0


def summarize(
    records: list[dict[str, Any]],
    *,
    model: str,
    data: str,
    started: float,
    duration_s: float,
    ablate_images: bool,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The report: headline numbers, settings and the per-sample `records` (under `samples`).

    A sample failed when its request or generation raised (`error` set); a wrong answer is not a failure.
    `accuracy` = correct / (num_samples - num_failed), 0.0 when every sample failed; `mean_reward` and the
    nearest-rank latency percentiles are over the samples that did not fail (None when none did).
    `tokens_per_s` = tokens generated / `duration_s` (the wall time of generating and scoring).
    `started` is a Unix time; `created` is it in ISO 8601 (UTC). `extra` adds fields (engine, adapter, ...).
    """
    done = [r for r in records if r["error"] is None]
    num_failed = len(records) - len(done)
    num_correct = sum(bool(r["correct"]) for r in done)
    latencies = [float(r["latency_ms"]) for r in done]
    num_tokens = sum(int(r["num_tokens"]) for r in done)
    report: dict[str, Any] = {
        "model": model,
        "data": data,
        "ablate_images": ablate_images,
        "created": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "num_samples": len(records),
        "num_failed": num_failed,
        "num_correct": num_correct,
        "accuracy": accuracy(records),
        "mean_reward": sum(float(r["reward"]) for r in done) / len(done) if done else None,
        "latency_ms_p50": nearest_rank(latencies, 50),
        "latency_ms_p95": nearest_rank(latencies, 95),
        "num_tokens": num_tokens,
        "tokens_per_s": num_tokens / duration_s if duration_s > 0 else None,
        "duration_s": duration_s,
    }
    report.update(extra or {})
    report["samples"] = records
    return report


def _cell(value: Any, width: int = 60) -> str:
    """A Markdown table cell: None as '-', floats to 3 decimals, no pipes or line breaks, cut to `width`."""
    if value is None:
        return "-"
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    text = text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")
    return text if len(text) <= width else text[: width - 3] + "..."


HEADLINE = (
    "model", "data", "accuracy", "num_samples", "num_failed", "mean_reward",
    "latency_ms_p50", "latency_ms_p95", "tokens_per_s", "ablate_images", "created",
)  # fmt: skip


def render_markdown(report: dict[str, Any]) -> str:
    """A short human-readable twin of the report: headline numbers and the first samples."""
    lines = ["# visionrl evaluation", "", "| metric | value |", "| --- | --- |"]
    lines += [f"| {key} | {_cell(report.get(key), 200)} |" for key in HEADLINE]
    judges = report.get("judges") or {}
    for key, j in judges.items():
        failed = f", {j['errors']} failed, {j['timeouts']} timed out" if j["errors"] or j["timeouts"] else ""
        what = f"mean {_cell(j['mean'])}, accepted {_cell(j['accepted'])} of {j['num_judged']}{failed}"
        lines.append(f"| judge {key} ({j['backend']}) | {what} |")
    samples = report.get("samples", [])
    shown = samples[:MARKDOWN_SAMPLES]
    lines += ["", f"## First {len(shown)} of {len(samples)} samples", ""]
    head = ["id", "answer", "completion", "reward", "correct", *(f"judge {k}" for k in judges), "error"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in shown:
        scores = [(r.get("judge") or {}).get(k) for k in judges]
        cells = [r["id"], r["answer"], r["completion"], r["reward"], r["correct"], *scores, r["error"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: str | Path) -> None:
    """Write `report` as JSON at `out` and as Markdown at `out` with the suffix `.md`; both atomically."""
    path = Path(out)
    if path.suffix.lower() == ".md":
        raise InputError(
            f"report path '{path}' ends in .md, which is the Markdown twin's name; use e.g. .json"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, text in (
        (path, json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n"),
        (path.with_suffix(".md"), render_markdown(report)),
    ):
        with storage_errors(target, len(text.encode()), kept=f"{target} was left as it was."):
            atomic_write(target, text)


DEFAULT_REWARDS = ("exact_match",)
JudgeStep = Callable[[list[PromptItem], list[dict[str, Any]]], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class EvalSettings:
    """What every evaluator is asked and records in its report: the records to read (`data`), the report to
    write (`out`), the rewards that score (each of weight 1), the answer length, and whether images are
    permuted across samples (`ablate_images`, by `seed`).

    Raises InputError when it is made for a data file that does not exist: before any model is loaded.
    """

    data: str
    out: str
    rewards: tuple[str, ...] = DEFAULT_REWARDS
    max_tokens: int = 32
    seed: int = 0
    ablate_images: bool = False

    def __post_init__(self) -> None:
        if not os.path.isfile(self.data):
            raise InputError(
                f"data file '{self.data}' not found; pass a JSONL or Parquet file of evaluation records"
            )

    def reward_fn(self) -> CombinedReward:
        """The scoring rewards; raises InputError (RewardConfigError) for an unknown name. Close it after."""
        return build_reward_fn([RewardSpec(name) for name in self.rewards])

    def prompts(self, prompts: list[PromptItem]) -> list[PromptItem]:
        """`prompts`, with the images permuted across samples when `ablate_images` is set."""
        return ablate(prompts, self.seed) if self.ablate_images else prompts

    def report(
        self,
        prompts: list[PromptItem],
        answer: Callable[[], Sequence[Generation]],
        reward_fn: CombinedReward,
        *,
        model: str,
        extra: dict[str, Any],
        judge: JudgeStep | None = None,
    ) -> dict[str, Any]:
        """Call `answer` (one Generation per prompt, in order), score the answers against `prompts`, write
        the report at `out` and return it. Its `duration_s` (and so `tokens_per_s`) is the wall time of
        answering and scoring; `extra` adds the evaluator's own fields next to rewards, max_tokens and seed.
        `judge(prompts, records)` (`eval --judge`) adds each sample's judge scores and returns the judges'
        summaries (the report's `judges`), after the timing."""
        started, t0 = time.time(), time.perf_counter()
        records = score_generations(prompts, answer(), reward_fn)
        duration_s = time.perf_counter() - t0
        fields = {**extra, "rewards": list(self.rewards), "max_tokens": self.max_tokens, "seed": self.seed}
        if judge is not None:
            fields["judges"] = judge(prompts, records)
        report = summarize(
            records,
            model=model,
            data=self.data,
            started=started,
            duration_s=duration_s,
            ablate_images=self.ablate_images,
            extra=fields,
        )
        write_report(report, self.out)
        return report
