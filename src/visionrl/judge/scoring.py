"""One judge entry's scoring of completions, wherever its verdicts come from: the questions rendered from the
entry's template, a cache of verdicts, one batch per call of its backend, the verdicts read and counted, and the
stop when it fails on every sample of `max_failed_steps` steps in a row. Training (`orchestrate.judging`) gives it
engines, judge actors or an endpoint as the backend; `visionrl eval --judge` gives it a local engine, a judge model
in the process, or an endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from visionrl.config import JobConfig
from visionrl.data.prompts import question_text
from visionrl.errors import RunError
from visionrl.rewards.combined import component_keys
from visionrl.rewards.judge import JUDGE as JUDGE_REWARD
from visionrl.rewards.judge import (
    JudgeFailure,
    JudgeRequest,
    JudgeSpec,
    VerdictCache,
    image_digest,
    judge_template,
    pair_key,
    read_verdict,
    render,
)
from visionrl.types import Completion, PromptItem

logger = logging.getLogger(__name__)
Raw = float | str | None | JudgeFailure
Backend = Callable[[list[JudgeRequest]], Sequence[Raw]]


@dataclass
class JudgeScores:
    """One judge's scores of a step: per sample its score (on_error where it failed) and verdict, and counts."""

    key: str
    scores: list[float]
    verdicts: list[str]
    errors: int = 0
    timeouts: int = 0
    cached: int = 0
    seconds: float = 0.0
    first_error: str = ""


def judge_entries(cfg: JobConfig) -> list[tuple[str, JudgeSpec]]:
    """(component key, spec) of each judge of the job."""
    specs = cfg.reward_specs()
    return [
        (key, JudgeSpec.from_kwargs(s.kwargs))
        for key, s in zip(component_keys(specs), specs, strict=True)
        if s.name == JUDGE_REWARD
    ]


class Judging:
    """One judge entry: renders the questions, keeps the cache, calls `backend`, reads and counts the verdicts."""

    def __init__(
        self, key: str, spec: JudgeSpec, backend: Backend, prompt_key: str, actors: list[Any]
    ) -> None:
        self.key, self.spec, self.backend, self.prompt_key = key, spec, backend, prompt_key
        self.template = judge_template(spec)
        self.cache = VerdictCache(spec.cache_size)
        self.actors = actors  # the judge actors of a `vllm` backend (stopped with the run)
        self.failed_in_a_row = 0

    def requests(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> list[JudgeRequest]:
        out = []
        for prompt, group in zip(prompts, completions, strict=True):
            question = question_text(prompt.record, self.prompt_key)
            for c in group:
                text = render(self.template, question, prompt.answer, c.text, self.spec.max_completion_chars)
                answer = c.text[: self.spec.max_completion_chars]
                out.append(JudgeRequest(text, tuple(prompt.images), question, answer))
        return out

    def score(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> JudgeScores:
        t0 = time.perf_counter()
        requests = self.requests(prompts, completions)
        per_prompt = [image_digest(p.images) for p in prompts]  # once per prompt, not per completion
        digests = [d for d, g in zip(per_prompt, completions, strict=True) for _ in g]
        keys = [pair_key(r.text, d) for r, d in zip(requests, digests, strict=True)]
        out = JudgeScores(self.key, [self.spec.on_error] * len(requests), ["error"] * len(requests))
        todo: dict[str, list[int]] = {}  # key -> samples: a pair asked twice in a batch is judged once
        for i, k in enumerate(keys):
            hit = self.cache.get(k)
            if hit is not None:
                out.scores[i], out.verdicts[i] = hit, "cached"
                out.cached += 1
            else:
                todo.setdefault(k, []).append(i)
        unique = list(todo)
        raws = self.backend([requests[todo[k][0]] for k in unique]) if unique else []
        for k, raw in zip(unique, raws, strict=True):
            verdict = raw if isinstance(raw, JudgeFailure) else read_verdict(self.spec, raw)
            for i in todo[k]:
                if isinstance(verdict, JudgeFailure):
                    out.timeouts += verdict.timeout
                    out.errors += not verdict.timeout
                    out.first_error = out.first_error or verdict.message
                    out.verdicts[i] = "timeout" if verdict.timeout else "error"
                else:
                    out.scores[i], out.verdicts[i] = verdict
            if not isinstance(verdict, JudgeFailure):
                self.cache.put(k, verdict[0])
        out.seconds = time.perf_counter() - t0
        if out.errors or out.timeouts:
            logger.warning(
                "judge reward %r: %d error(s) and %d timeout(s) in this step's %d judgements (scored on_error=%g); the first: %s",
                self.key,
                out.errors,
                out.timeouts,
                len(requests),
                self.spec.on_error,
                out.first_error,
            )
        self._watch(out)
        return out

    def _watch(self, out: JudgeScores) -> None:
        """Stop the run once every judgement of `max_failed_steps` steps in a row failed."""
        n = len(out.scores)
        if n == 0 or out.errors + out.timeouts < n:
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        limit = self.spec.max_failed_steps
        if limit and self.failed_in_a_row >= limit:
            raise RunError(
                f"the judge ({self.key}, backend {self.spec.backend}) failed on every sample of {limit} step(s) in "
                f"a row, so the run has no reward to learn from; its first error: {out.first_error}\nTo fix: check "
                "the judge's model, endpoint (base_url, api_key_env) and timeout_s in the job file's rewards"
            )
