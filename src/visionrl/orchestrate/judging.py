"""The run's judges: each `judge` entry of the job's rewards, scoring a step's completions beside the rule rewards.

Each entry is a `judge.scoring.Judging` (its questions, cache, verdicts and counters); here are its backends in a
run: one batch per engine or judge actor (or concurrent requests to an endpoint):
- `engine`: the rollout engines themselves, the adapter switched off: the base model judges, no extra memory;
- `vllm`: judge actors, each with its own vLLM engine of the judge model (`judge.model`);
- `classifier`: judge actors, each with a transformers reward model (`judge.classifier`);
- `endpoint`: an OpenAI-compatible server (`judge.endpoint`), called from the driver.
A batch past `timeout_s`, a dead judge actor or a failing request scores `on_error` for its samples and is
counted (errors, timeouts); a hung actor is killed and Ray restarts it. When every judgement of
`max_failed_steps` steps in a row failed, the run stops with the judge's first error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from visionrl import faults
from visionrl.config import JobConfig
from visionrl.data.prompts import user_prompt
from visionrl.judge import own_judge
from visionrl.judge.scoring import Backend, JudgeScores, Judging, Raw, judge_entries
from visionrl.orchestrate import console
from visionrl.orchestrate.actors import memory_guard, placement, use_torch_threads
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
from visionrl.orchestrate.scheduling import with_actor_env
from visionrl.rewards.combined import RewardResult, component_keys
from visionrl.rewards.judge import JudgeFailure, JudgeRequest, JudgeSpec, judge_ask
from visionrl.rewards.registry import RewardSpec

logger = logging.getLogger(__name__)


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
    """A judge model of its own (a `judge` reward with backend vllm or classifier): its vLLM engine and processor
    (`judge.model`), or a reward model in transformers (`judge.classifier`)."""

    def __init__(self, spec: JudgeSpec, cfg: JobConfig, index: int = 0) -> None:
        console.quiet_actor()
        use_torch_threads(cfg)
        self.index, self.calls = index, 0
        with memory_guard("judge", "start-up", cfg):
            device = "cuda" if spec.num_gpus > 0 else "cpu"  # a classifier's; a vLLM engine places itself
            seed, cache = cfg.train.seed + index, cfg.rollout.kv_cache_gib
            self.model = own_judge(spec, seed=seed, kv_cache_gib=cache, device=device)

    def judge(self, requests: list[JudgeRequest]) -> Sequence[float | str | None]:
        self.calls += 1
        for fault in ("kill_judge", "hang_judge"):
            faults.at_call(fault, self.index, self.calls)
        return self.model.judge(requests)

    def placement(self) -> dict[str, Any]:
        return placement()

    def close(self) -> None:
        self.model.close()


def start_judge_actors(cfg: JobConfig, spec: JudgeSpec) -> list[Any]:
    """The judge actors of `spec` (backend vllm or classifier), each answering its placement before the run goes on."""
    opts: dict[str, Any] = {
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "max_restarts": cfg.ray.max_actor_restarts,
    }
    with_actor_env([opts])
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
    """A `Judging` for each judge entry of the job, its judge actors started (backends vllm, classifier) and answering."""
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
