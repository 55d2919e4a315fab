"""The fan-out over Ray actors: `Workers`, the loop's view of the learner ranks, engines and reward workers.

`Workers` hides how many of each there are: every learner call goes to all ranks (`orchestrate.learners`),
prompts are split evenly over engines (each prompt's group on one engine), completions over reward workers, and
every adapter version is put in the object store once and loaded by all engines. It also restarts an engine or
reward worker that died or hung, and writes what the driver writes (checkpoints, the final adapter). The data
side is `orchestrate.prompt_stream`; merging the reward workers' parts is `rewards.merge`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import ray

from visionrl import metrics as tags
from visionrl.config import JobConfig
from visionrl.envs.episodes import EpisodeRunner
from visionrl.errors import RunError, StorageError, storage_errors
from visionrl.judge.scoring import Judging
from visionrl.orchestrate.delivery import (
    FINGERPRINT_TOKENS,
    FingerprintPrompt,
    PartProbe,
    check_probes,
    diffs_by_engine,
    scoring_batch,
)
from visionrl.orchestrate.engine_lanes import EngineLane, RemoteEngine, engine_spec
from visionrl.orchestrate.env_workers import EnvPool
from visionrl.orchestrate.failures import resume_hint
from visionrl.orchestrate.judging import join_scores, start_judges
from visionrl.orchestrate.learners import CALL_KEY, LearnerGroup
from visionrl.orchestrate.prompt_stream import PromptStream
from visionrl.orchestrate.remote import (
    ENGINE,
    JUDGE,
    LEARNER,
    REWARD,
    ActorFailed,
    ActorHung,
    ActorProblem,
    Call,
    gather,
    kill_actors,
    split_evenly,
    wait_until_back,
)
from visionrl.rewards import CombinedReward, RewardResult, RewardSpec, build_reward_fn
from visionrl.rewards.merge import merge_results
from visionrl.run_layout import RunDir
from visionrl.train.learner import TrainBatch
from visionrl.types import Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")
ACTOR_RESTARTS_KEY = "actor_restarts"  # in a checkpoint's extra: the restarts the run had used by then


@dataclass(frozen=True)
class Synced:
    """An adapter sync: the version the engines serve now, and each engine's fingerprint difference under it."""

    version: int
    fingerprint_diffs: list[float]
    load_s: float = 0.0  # the adapter to every engine and loaded there
    check_s: float = 0.0  # the fingerprint after the load: the engines' part, and the learner's when greedy
    # the slowest engine's seconds of each part: load_s's (the learner's build, the way to the engine, the
    # engine's own parts) and check_s's (the engines' fingerprint, the learner's scoring after it)
    parts: dict[str, float] = field(default_factory=dict)


def reward_deadline_s(cfg: JobConfig, completions: int) -> float:
    """Deadline of one reward worker's batch: every call may use its full ray.reward_timeout_s (the thread
    runner runs a few at once, so this is generous), plus a margin for starting the process runner's child."""
    calls = completions * len(cfg.rewards)
    margin = 120.0 if cfg.ray.reward_isolation == "process" else 10.0
    return margin + calls * cfg.ray.reward_timeout_s


class Workers:
    """The loop's view of the actors. Every remote call has a deadline (`remote.gather`); a rollout engine or
    reward worker that dies or hangs is restarted (at most ray.max_actor_restarts times in the run, resumes
    included: checkpoints carry the count), an engine gets the current adapter again (verified), and the call
    is retried; anything else raises `ActorProblem`, which the loop reports with the checkpoint to resume from."""

    def __init__(self, learners: list[Any], engines: list[Any], rewards: list[Any], cfg: JobConfig) -> None:
        self.learners = LearnerGroup(learners, cfg.ray.call_timeout_s)  # the ranks, called as one learner
        self.engines, self.rewards, self.cfg = engines, rewards, cfg
        self._eval_reward: CombinedReward | None = None
        self.judges: list[Judging] = []  # the job's judge rewards (`attach_judges`)
        self.episodes: EpisodeRunner | None = None  # multi-turn episodes (`attach_envs`)
        self.restarts = 0
        self._probe_prompts: list[PromptItem] = []  # set by verify_delivery
        self._check: FingerprintPrompt | None = None  # the fingerprint's prompt (its first), set there too
        self._rebuilds = [0] * len(engines)  # each engine's rebuilds after internal errors, as last seen

    def attach_judges(self, processor: Any) -> None:
        """Start the job's judges (`processor`: the policy's, for the engine backend); none when it has no judge."""
        self.judges = start_judges(self.cfg, self.engines, processor)

    def attach_envs(self, processor: Any) -> None:
        """Start the env workers of the job's `env` and the runner of its episodes (`processor`: the policy's)."""
        assert self.cfg.env is not None
        self.episodes = EpisodeRunner.of(self.cfg, processor, EnvPool(self.cfg.env))

    def _get(self, calls: list[Call], phase: str, interruptible: bool = False) -> list[Any]:
        return gather(calls, phase, self.cfg.ray.call_timeout_s, CALL_KEY, interruptible)

    def _recovering(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, retried after restarting an engine or reward worker that died or hung in it."""
        while True:
            try:
                return attempt()
            except ActorProblem as problem:
                self._restart(problem)

    def _restart(self, problem: ActorProblem) -> None:
        limit = self.cfg.ray.max_actor_restarts
        if problem.role == LEARNER:
            raise problem  # its optimizer state lives only there: the run continues from the checkpoint
        if isinstance(problem, ActorFailed) and (not problem.died or problem.init_error):
            raise problem  # it raised (also in its constructor): it would raise again; the cause goes to the user
        if self.restarts >= limit:
            problem.args = (
                f"{problem}\n(restarted {self.restarts} of ray.max_actor_restarts={limit} times)",
            )
            raise problem
        self.restarts += 1
        logger.warning(
            "%s\nrestarting the %s (restart %d of ray.max_actor_restarts=%d)",
            problem,
            problem.actor,
            self.restarts,
            limit,
        )
        actors = self.engines if problem.role == ENGINE else self.rewards
        actor = actors[problem.index]
        if isinstance(problem, ActorHung):  # a dead one is being rebuilt by Ray already (max_restarts)
            ray.kill(actor, no_restart=False)  # SIGKILL, also for a stopped process; Ray rebuilds it in place
        place = wait_until_back(
            actor, problem.role, problem.index, self.cfg.ray.startup_timeout_s, "ray.startup_timeout_s"
        )
        logger.info("%s restarted: %s", problem.actor, place)
        if problem.role == ENGINE:
            self._resync(problem.index)

    def _resync(self, index: int) -> None:
        """A restarted engine must serve the learner's version and apply every adapter part as the learner does."""
        engine = self.engines[index]
        payload = self.learners.adapter_payload_pending()
        load_call = Call(engine.load_adapter.remote(payload.ref), ENGINE, index)
        (version, _), served = self._get([load_call, *payload.calls], "sync")[:2]  # rank 0's payload second
        if version != served.version:
            raise RunError(
                f"rollout engine {index} after its restart serves adapter version {version}, the learner's is "
                f"{served.version}: it does not serve the policy being trained, so the run stops"
            )
        self._rebuilds[index] = 0
        self._probe([index], "after its restart")
        logger.info("rollout engine %d serves adapter version %d again (verified)", index, version)

    # 2. rollout
    def rollout(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        chunks = split_evenly(prompts, len(self.engines))

        def attempt() -> list[list[Completion]]:
            calls = [
                Call(e.generate.remote(c, engine_spec(spec, i)), ENGINE, i)
                for i, (e, c) in enumerate(zip(self.engines, chunks, strict=True))
                if c
            ]
            return [group for part in self._get(calls, "rollout", True) for group in part]

        return self._recovering(attempt)

    def rollout_on(self, index: int, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        """`rollout` on engine `index` alone (an episode lane: `envs.episodes`), restarted like the others."""

        def attempt() -> list[list[Completion]]:
            call = Call(self.engines[index].generate.remote(prompts, engine_spec(spec, index)), ENGINE, index)
            return list(self._get([call], "rollout", True)[0])

        return self._recovering(attempt)

    def rollout_lanes(self) -> list[Callable[[list[PromptItem], SamplingSpec], list[list[Completion]]]]:
        """One generate per engine: multi-turn episodes play each engine's share in a lane of its own."""
        return [partial(self.rollout_on, i) for i in range(len(self.engines))]

    def episode_lanes(self) -> list[Any]:
        """The engines as the job's `env.pipeline` plays them: stepping lanes (continuous) or generates (turns)."""
        if self.cfg.env is not None and self.cfg.env.pipeline == "continuous":
            return [EngineLane(self, i) for i in range(len(self.engines))]
        return self.rollout_lanes()

    # at start: the adapter reaches the engines
    def verify_delivery(self, prompts: list[PromptItem]) -> list[PartProbe]:
        """Every engine must apply each part of the adapter as the learner does (`orchestrate.delivery`), else
        the run would train an adapter that rollouts never use. The learner's own version is served first:
        once vLLM has held a LoRA, requests without one can still get its weights (docs/ENGINE_NOTES.md), so
        "no adapter" is never served, and every probe compares two explicit adapters."""
        self._probe_prompts = prompts  # kept: a restarted engine is probed again
        self._check = FingerprintPrompt(prompts[0])
        synced = self.sync_adapter()
        bound = self.cfg.rollout.max_logprob_diff
        far = [(i, d) for i, d in enumerate(synced.fingerprint_diffs) if d > bound]
        if far:
            raise RunError(
                f"rollout engine(s) {[i for i, _ in far]} score the fingerprint prompt under the learner's first "
                f"adapter {max(d for _, d in far):.3g} nats per token away from the learner (over "
                f"rollout.max_logprob_diff={bound:g}): the engine and the learner do not run the same model. Check "
                "model.dtype and that both load model.path"
            )
        probes = self._probe(list(range(len(self.engines))), "at start-up")
        logger.info("adapter delivery verified:\n%s", "\n".join(p.describe() for p in probes))
        return probes

    def _probe(self, indices: list[int], when: str) -> list[PartProbe]:
        """The probe of engines `indices`, one adapter part at a time; raises RunError when one fails."""
        probes: list[PartProbe] = []
        for part in self.learners.probe_parts():
            payload = self.learners.probe_payload_pending(part)
            calls = [
                Call(self.engines[i].probe.remote(payload.ref, self._probe_prompts), ENGINE, i)
                for i in indices
            ]
            results = self._get([*calls, *payload.calls], "the adapter probe", True)[: len(calls)]
            batch, owners = scoring_batch(self._probe_prompts, [r.completions for r in results])
            probed, own = self.learners.probe_logprobs(part, batch)
            engine_lps = [seq.sampling_logprobs for seq in batch.sequences]
            diffs = diffs_by_engine(owners, engine_lps, probed, len(results))
            effects = diffs_by_engine(owners, probed, own, len(results))
            probes += [
                PartProbe(i, part, r, d, e)
                for i, r, d, e in zip(indices, results, diffs, effects, strict=True)
            ]
        check_probes(probes, self.cfg.rollout.max_logprob_diff, when)
        return probes

    # 3. reward
    def score(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> RewardResult:
        """The job's rewards: the rule rewards on the reward workers, each judge by its backend (`orchestrate.judging`)."""
        judged = [judge.score(prompts, completions) for judge in self.judges]
        rules = self._score_rules(prompts, completions) if self.rewards else None
        if not judged and rules is not None:
            return rules
        n = sum(len(group) for group in completions)
        return join_scores(self.cfg.reward_specs(), rules, judged, n)

    def _score_rules(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> RewardResult:
        texts = [c.text for group in completions for c in group]
        records = [_reward_record(p) for p, group in zip(prompts, completions, strict=True) for _ in group]
        n = len(self.rewards)
        parts_in = [
            (i, t, r)
            for i, (t, r) in enumerate(zip(split_evenly(texts, n), split_evenly(records, n), strict=True))
            if t
        ]
        deadline = reward_deadline_s(self.cfg, max((len(t) for _, t, _ in parts_in), default=0))

        def attempt() -> list[RewardResult]:
            calls = [Call(self.rewards[i].score.remote(t, r), REWARD, i) for i, t, r in parts_in]
            return gather(calls, "reward", deadline, "ray.reward_timeout_s", interruptible=True)

        return merge_results(self._recovering(attempt))

    # 5. learner update
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """The learner's step; with `rollout.sleep_during_update` the engines sleep meanwhile (their GPU memory
        goes to the colocated learner) and are awake again before it returns. Not interruptible: once the
        update runs, the step is finished (and checkpointed) before a requested stop."""
        sleep = self.cfg.rollout.sleep_during_update
        engines = [(i, e) for i, e in enumerate(self.engines)]
        t0 = time.perf_counter()
        if sleep:
            self._get([Call(e.sleep.remote(), ENGINE, i) for i, e in engines], "update (engine sleep)")
        t1 = time.perf_counter()
        stats = self.learners.train_step(batch)  # metrics summed over the ranks already
        stats[tags.LEARNER_RANKS] = float(len(self.learners))
        t2 = time.perf_counter()
        if sleep:
            self._get([Call(e.wake_up.remote(), ENGINE, i) for i, e in engines], "update (engine wake-up)")
            stats[tags.ENGINE_SLEEP] = t1 - t0
            stats[tags.ENGINE_WAKE] = time.perf_counter() - t2
        return stats

    # 6. sync
    def sync_adapter(self) -> Synced:
        """The learner's adapter to every engine, and each engine's fingerprint under it. Once the fingerprint's
        continuation is fixed, the learner scores it while the engines load (`orchestrate.delivery`)."""
        fixed = self._check.forced_batch() if self._check is not None else None

        def attempt() -> tuple[int, dict[str, float], list[float] | None]:
            # rank 0's payload, resolved once in the object store; every rank takes part in building it
            payload = self.learners.adapter_payload_pending()
            scoring = self.learners.raw_logprobs_pending(fixed).calls if fixed is not None else []
            calls = [Call(e.load_adapter.remote(payload.ref), ENGINE, i) for i, e in enumerate(self.engines)]
            got = self._get([*calls, *payload.calls, *scoring], "sync")  # the learners' calls run in order
            versions = [version for version, _ in got[: len(calls)]]
            if len(set(versions)) != 1:
                raise RunError(f"engines serve different adapter versions after sync: {versions}")
            parts: dict[str, float] = {}
            for _, engine_parts in got[: len(calls)]:
                for name, seconds in engine_parts.items():
                    parts[name] = max(parts.get(name, 0.0), seconds)
            return int(versions[0]), parts, got[len(calls) + len(payload.calls)][0] if scoring else None

        t0 = time.perf_counter()
        version, parts, learner = self._recovering(attempt)
        t1 = time.perf_counter()
        diffs, check_parts = self._fingerprint(learner)
        return Synced(version, diffs, t1 - t0, time.perf_counter() - t1, {**parts, **check_parts})

    def _fingerprint(self, learner: list[float] | None) -> tuple[list[float], dict[str, float]]:
        """Each engine's log-probs of the fingerprint's continuation under the version it serves against the
        learner's, which holds that version until its next update: mean |engine - learner| per token. With
        `learner` (its scores of the fixed continuation) the engines teacher-force that continuation; else they
        complete the prompt greedily, the learner scores each completion, and the first fixes the continuation.
        An engine that rebuilt itself since the last fingerprint is probed again first. Also the seconds of the
        engines' part (`check_engine`) and of the learner's scoring after it (`check_learner`, 0 when it was fixed)."""
        assert self._check is not None, "verify_delivery sets the fingerprint prompt"
        prompt = self._check.prompt
        continuation = self._check.continuation if learner is not None else None

        def attempt() -> list[tuple[Completion | None, int]]:
            calls = [
                Call(e.fingerprint.remote(prompt, FINGERPRINT_TOKENS, continuation), ENGINE, i)
                for i, e in enumerate(self.engines)
            ]
            return self._get(calls, "the adapter fingerprint")

        t = time.perf_counter()
        got = self._recovering(attempt)
        engine_s = time.perf_counter() - t
        rebuilt = [i for i, (_, count) in enumerate(got) if count > self._rebuilds[i]]
        if rebuilt:
            self._probe(rebuilt, "after the engine rebuilt itself")
            for i in rebuilt:
                self._rebuilds[i] = got[i][1]
            logger.info(
                "rollout engine(s) %s rebuilt after an internal error: adapter delivery verified", rebuilt
            )
        batch, owners = scoring_batch([prompt], [[[c] if c is not None else []] for c, _ in got])
        rows = [seq.sampling_logprobs for seq in batch.sequences]
        if learner is not None:  # the learner scored the continuation during the load: none of check_s
            seconds = {"check_engine": engine_s, "check_learner": 0.0}
            return diffs_by_engine(owners, rows, [learner] * len(rows), len(got)), seconds
        t = time.perf_counter()
        scores = self.learners.logprobs(batch, temperature=1.0)
        self._check.fix([c for c, _ in got])
        seconds = {"check_engine": engine_s, "check_learner": time.perf_counter() - t}
        return diffs_by_engine(owners, rows, scores, len(got)), seconds

    # 7. evaluate
    def evaluate(self, prompts: list[PromptItem]) -> float | None:
        if not prompts:
            return None
        from visionrl.eval.local import evaluate_prompts
        from visionrl.eval.report import accuracy

        if self._eval_reward is None:
            # a job whose only reward is a judge is evaluated by exact match against the held-out answers
            self._eval_reward = build_reward_fn(
                self.cfg.reward_specs(judges=False) or [RewardSpec("exact_match")],
                timeout_s=self.cfg.ray.reward_timeout_s,
                isolation=self.cfg.ray.reward_isolation,
            )
        if self.episodes is not None:  # multi-turn: one greedy episode per prompt, its final turn scored
            from visionrl.eval.episodes import episode_answers
            from visionrl.eval.scoring import score_generations

            answers, _ = episode_answers(
                RemoteEngine(self), prompts, self.episodes, max_tokens=self.cfg.rollout.max_new_tokens
            )
            return accuracy(score_generations(prompts, answers, self._eval_reward))
        records = evaluate_prompts(
            RemoteEngine(self),
            prompts,
            self._eval_reward,
            max_tokens=self.cfg.rollout.max_new_tokens,
        )
        return accuracy(records)

    # 7. checkpoint
    def checkpoint(
        self, run: Path, step: int, prompts: PromptStream, sampler_state: dict[str, Any] | None = None
    ) -> Path:
        """Save step `step`; `sampler_state` (default: the sampler's now) is the data position after it."""
        from visionrl.checkpoint import save_checkpoint

        saved = self.learners.save()  # the adapter in full precision, the trainer state
        return save_checkpoint(
            run,
            step,
            adapter_files=saved.adapter.files,
            trainer_state=saved.trainer_state,
            sampler_state=sampler_state if sampler_state is not None else prompts.sampler.state_dict(),
            # the settings it was trained with: a resume compares them (orchestrate.resume)
            # the restarts used so far: ray.max_actor_restarts bounds the run, resumes included
            extra={
                "adapter_version": saved.adapter.version,
                "config": self.cfg.model_dump(mode="json"),
                ACTOR_RESTARTS_KEY: self.restarts,
            },
            keep=self.cfg.logging.keep_checkpoints,
        )

    def resume(self, path: Path, prompts: PromptStream) -> int:
        """Restore learner, sampler and engines from the checkpoint at `path`; returns its step."""
        from visionrl.checkpoint import load_checkpoint

        ckpt = load_checkpoint(path)
        self.learners.load(ckpt.adapter_dir, ckpt.trainer_state)
        prompts.sampler.load_state_dict(ckpt.sampler_state)
        # checkpoints written before the count was kept: none counted
        self.restarts = int(ckpt.extra.get(ACTOR_RESTARTS_KEY, 0))
        self.sync_adapter()
        used = f"{self.restarts} of ray.max_actor_restarts={self.cfg.ray.max_actor_restarts}"
        logger.info("resumed from %s (step %d; actor restarts used: %s)", path, ckpt.step, used)
        return ckpt.step

    # end of run
    def export_final(self, run: Path, accuracy: float | None) -> Path:
        """Write the run's adapter (the learner's, full precision, as in checkpoints) and its manifest, last. The
        driver writes it, as it writes checkpoints, so it lands in output_dir whichever node the learner is on. A
        full or unwritable disk: StorageError with the checkpoint to continue from (which exports again)."""
        from visionrl.adapter.files import write_adapter_files
        from visionrl.adapter.manifest import MANIFEST_NAME, build_manifest, write_manifest
        from visionrl.adapter.storage import filesystem

        adapter_dir = RunDir(run).adapter
        files = self.learners.adapter_payload("export", for_engine=False).files
        try:
            kept = "No manifest was written, so no reader takes this export."
            with storage_errors(adapter_dir, sum(len(data) for data in files.values()), kept=kept):
                # an old manifest never vouches for new files
                (adapter_dir / MANIFEST_NAME).unlink(missing_ok=True)
                write_adapter_files(adapter_dir, files)
            eval_results = {"accuracy": accuracy} if accuracy is not None else None
            manifest = build_manifest(
                adapter_dir,
                base_model=self.cfg.model.path,
                job_config=self.cfg.model_dump(mode="json"),
                eval_results=eval_results,
            )
            # Written last and atomically: a reader that finds the manifest finds a complete adapter.
            write_manifest(*filesystem(adapter_dir), manifest)
        except StorageError as err:
            raise StorageError(f"{err}\n{resume_hint(run)}") from None
        return adapter_dir

    def close(self) -> None:
        calls = [
            *[Call(e.close.remote(), ENGINE, i) for i, e in enumerate(self.engines)],
            *[Call(w.close.remote(), REWARD, i) for i, w in enumerate(self.rewards)],
            *[Call(a.close.remote(), JUDGE, i) for j in self.judges for i, a in enumerate(j.actors)],
        ]
        try:
            gather(calls, "shutdown", 60.0, "(shutdown)")
        except ActorProblem as problem:  # the run's work is saved: a failing close only costs a warning
            logger.warning("%s", problem)
        self.kill()

    def kill(self) -> None:
        """Stop every actor of the run at once (the end of `close`, or a failed run)."""
        envs = self.episodes.pool.actors if self.episodes is not None else []
        kill_actors(
            [
                *self.learners.actors,
                *self.engines,
                *self.rewards,
                *(a for j in self.judges for a in j.actors),
                *envs,
            ]
        )


def _reward_record(p: PromptItem) -> dict[str, Any]:
    record = dict(p.record)
    record.setdefault("answer", p.answer)
    return record
