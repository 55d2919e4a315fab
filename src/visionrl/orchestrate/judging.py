"""The run's judges: each `judge` entry of the job's rewards, scoring a step's completions beside the rule rewards.

For every completion the judge's question is the entry's template rendered with the record's question, its
reference answer and the completion (delimited: `rewards.judge`), with the prompt's images. Pairs judged before
come from a cache, the rest go out in one batch per engine or judge actor (or concurrent requests to an endpoint):
- `engine`: the rollout engines themselves, the adapter switched off: the base model judges, no extra memory;
- `vllm`: judge actors, each with its own vLLM engine of the judge model (`judge.model`);
- `endpoint`: an OpenAI-compatible server (`judge.endpoint`), called from the driver.
A batch past `timeout_s`, a dead judge actor or a failing request scores `on_error` for its samples and is
counted (errors, timeouts); a hung actor is killed and Ray restarts it. When every judgement of
`max_failed_steps` steps in a row failed, the run stops with the judge's first error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from visionrl import faults
from visionrl.config import JobConfig
from visionrl.data.prompts import question_text, user_prompt
from visionrl.errors import RunError
from visionrl.orchestrate.actors import memory_guard, placement, use_torch_threads, with_fault_env
from visionrl.orchestrate.remote import (
    ENGINE,
    JUDGE,
    ActorFailed,
    ActorHung,
    ActorProblem,
    Call,
    gather,
    kill_actors,
    split_evenly,
    wait_until_back,
)
from visionrl.rewards.combined import RewardResult, component_keys
from visionrl.rewards.judge import JUDGE as JUDGE_REWARD
from visionrl.rewards.judge import (
    JudgeFailure,
    JudgeRequest,
    JudgeSpec,
    VerdictCache,
    image_digest,
    judge_ask,
    load_template,
    pair_key,
    read_verdict,
    render,
)
from visionrl.rewards.registry import RewardSpec
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
        self.template = load_template(spec.template)
        self.cache = VerdictCache(spec.cache_size)
        self.actors = actors  # the judge actors of a `vllm` backend (stopped with the run)
        self.failed_in_a_row = 0

    def requests(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> list[JudgeRequest]:
        out = []
        for prompt, group in zip(prompts, completions, strict=True):
            question = question_text(prompt.record, self.prompt_key)
            for c in group:
                text = render(self.template, question, prompt.answer, c.text, self.spec.max_completion_chars)
                out.append(JudgeRequest(text, tuple(prompt.images)))
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


def settle(calls: list[tuple[Call, list[int]]], n: int, timeout_s: float, kill_hung: list[Any]) -> list[Raw]:
    """Each call's results spread over its samples; a call that failed or passed the deadline gives its samples a
    JudgeFailure. A hung actor of `kill_hung` (by index) is killed so Ray restarts it."""
    out: list[Raw] = [None] * n
    deadline = time.monotonic() + timeout_s
    key = "rewards[].kwargs.timeout_s (judge)"
    for call, samples in calls:
        try:
            got = gather([call], "judging", max(deadline - time.monotonic(), 0.01), key)[0]
        except ActorHung:
            what = (
                f"the {call.role} {call.index} did not answer within {timeout_s:g} s (the judge's timeout_s)"
            )
            if kill_hung:
                ray.kill(kill_hung[call.index], no_restart=False)
                what += "; it was stopped and Ray restarts it"
            got = [JudgeFailure(what, timeout=True)] * len(samples)
        except ActorFailed as failed:
            got = [JudgeFailure(str(failed).splitlines()[0])] * len(samples)
        for i, value in zip(samples, got, strict=True):
            out[i] = value
    return out


def engine_backend(engines: list[Any], processor: Any, spec: JudgeSpec) -> Backend:
    """The rollout engines judge with the adapter switched off; the prompts are templated for the policy's model."""
    ask = judge_ask(spec, processor.tokenizer)

    def run(requests: list[JudgeRequest]) -> list[Raw]:
        prompts = [user_prompt(processor, r.text, r.images) for r in requests]
        calls = [
            (Call(engines[i].judge.remote([prompts[j] for j in idx], ask), ENGINE, i), idx)
            for i, idx in enumerate(split_evenly(list(range(len(prompts))), len(engines)))
            if idx
        ]
        return settle(calls, len(prompts), spec.timeout_s, [])

    return run


class ActorBackend:
    """Judge actors, each with the judge model's own engine; the requests are split evenly over them. An actor that
    died or hung in a call is being restarted by Ray: the next call first waits for it (up to `timeout_s`), so one
    death costs the judgements of one batch, not of every step while the actor is rebuilt."""

    def __init__(self, actors: list[Any], spec: JudgeSpec) -> None:
        self.actors, self.spec = actors, spec
        self.down: set[int] = set()

    def __call__(self, requests: list[JudgeRequest]) -> list[Raw]:
        self._wait_for_restarts()
        calls = [
            (Call(self.actors[i].judge.remote([requests[j] for j in idx]), JUDGE, i), idx)
            for i, idx in enumerate(split_evenly(list(range(len(requests))), len(self.actors)))
            if idx
        ]
        out = settle(calls, len(requests), self.spec.timeout_s, self.actors)
        self.down |= {c.index for c, idx in calls if any(isinstance(out[j], JudgeFailure) for j in idx)}
        return out

    def _wait_for_restarts(self) -> None:
        """Up to `timeout_s` in all for the actors that failed last time; one still not back fails its next call,
        which is counted like any other."""
        deadline = time.monotonic() + self.spec.timeout_s
        for i in sorted(self.down):
            left, key = max(deadline - time.monotonic(), 0.01), "the judge's timeout_s"
            try:
                wait_until_back(self.actors[i], JUDGE, i, left, key)
                self.down.discard(i)
            except ActorProblem:
                pass


@ray.remote
class JudgeActor:
    """A judge model of its own (a `judge` reward with backend vllm): its engine and processor (`judge.model`)."""

    def __init__(self, spec: JudgeSpec, cfg: JobConfig, index: int = 0) -> None:
        from visionrl.judge.model import ModelJudge

        use_torch_threads(cfg)
        self.index, self.calls = index, 0
        with memory_guard("judge", "start-up", cfg):
            self.model = ModelJudge(spec, seed=cfg.train.seed + index, kv_cache_gib=cfg.rollout.kv_cache_gib)

    def judge(self, requests: list[JudgeRequest]) -> list[float | str | None]:
        self.calls += 1
        for fault in ("kill_judge", "hang_judge"):
            faults.at_call(fault, self.index, self.calls)
        return self.model.judge(requests)

    def placement(self) -> dict[str, Any]:
        return placement()

    def close(self) -> None:
        self.model.close()


def start_judge_actors(cfg: JobConfig, spec: JudgeSpec) -> list[Any]:
    """The judge actors of `spec` (backend vllm), each answering its placement before the run goes on."""
    opts: dict[str, Any] = {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "max_restarts": cfg.ray.max_actor_restarts,
    }
    with_fault_env([opts])
    actors = [JudgeActor.options(**opts).remote(spec, cfg, i) for i in range(spec.num_actors)]  # type: ignore[attr-defined]
    try:
        calls = [Call(a.placement.remote(), JUDGE, i) for i, a in enumerate(actors)]
        places = gather(
            calls, "start-up", cfg.ray.startup_timeout_s, "ray.startup_timeout_s", interruptible=True
        )
    except BaseException:
        kill_actors(actors)
        raise
    logger.info(
        "judge actors (%s): %s", spec.model, "; ".join(f"judge {i} {p}" for i, p in enumerate(places))
    )
    return actors


def start_judges(cfg: JobConfig, engines: list[Any], processor: Any) -> list[Judging]:
    """A `Judging` for each judge entry of the job, its judge actors started (backend vllm) and answering."""
    from visionrl.judge.endpoint import EndpointJudge

    judges: list[Judging] = []
    try:
        for key, spec in judge_entries(cfg):
            actors: list[Any] = []
            if spec.backend == "engine":
                backend = engine_backend(engines, processor, spec)
            elif spec.backend == "endpoint":
                backend = EndpointJudge(spec).judge
            else:
                actors = start_judge_actors(cfg, spec)
                backend = ActorBackend(actors, spec)
            judges.append(Judging(key, spec, backend, cfg.data.prompt_key, actors))
    except BaseException:
        kill_actors([a for j in judges for a in j.actors])
        raise
    return judges


def join_scores(
    specs: list[RewardSpec], rules: RewardResult | None, judged: list[JudgeScores], n: int
) -> RewardResult:
    """One result of the job's rewards in their order: the rule rewards' components (`rules`, scored by the reward
    workers) and each judge's, the total their weighted sum (as `CombinedReward` sums)."""
    by_key = {j.key: j for j in judged}
    keys = component_keys(specs)
    out = RewardResult(total=[0.0] * n, per_reward={})
    for spec, key in zip(specs, keys, strict=True):
        j = by_key.get(key)
        if j is not None:
            out.per_reward[key], out.num_errors[key], out.num_timeouts[key] = j.scores, j.errors, j.timeouts
            out.seconds[key], out.verdicts[key] = j.seconds, j.verdicts
            if j.first_error:
                out.error_examples[key] = j.first_error
        else:
            assert rules is not None  # a rule reward is scored by the reward workers
            out.per_reward[key] = rules.per_reward[key]
            out.num_errors[key], out.num_timeouts[key] = rules.num_errors[key], rules.num_timeouts[key]
            if key in rules.error_examples:
                out.error_examples[key] = rules.error_examples[key]
        for i, value in enumerate(out.per_reward[key]):
            out.total[i] += spec.weight * value
    return out
