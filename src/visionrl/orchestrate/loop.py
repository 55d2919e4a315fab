"""The GRPO loop. One step = the numbered phases of DESIGN.md, each one call; the helpers are below the loop.

1 sample prompts   2 rollout   3 reward   4 advantages   5 learner update   6 sync adapter   7 log/eval/save

With `rollout.async_steps: 1` phases 1-3 of the next step run during phase 5 (`orchestrate.pipeline` says how).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch

from visionrl import history as history_file
from visionrl import metrics as tags
from visionrl.algo import group_advantages, group_stats, groups_with_signal, overlong_penalty
from visionrl.config import JobConfig, dump_config
from visionrl.errors import Preempted, RunError, StorageError, storage_errors
from visionrl.files import atomic_write
from visionrl.metrics import MetricsWriter, Progress
from visionrl.models.sequences import Sequence
from visionrl.orchestrate import preemption
from visionrl.orchestrate.actors import ray_session, start_actors
from visionrl.orchestrate.failures import resume_hint, run_error, run_log, stopped
from visionrl.orchestrate.health import CollapseWatch, RunHealth
from visionrl.orchestrate.pipeline import Prefetch, warn_about_async_steps
from visionrl.orchestrate.preemption import stop_on_signals
from visionrl.orchestrate.prompt_stream import PromptStream
from visionrl.orchestrate.remote import ActorProblem, first_line
from visionrl.orchestrate.resume import ResumeMode, checkpoint_to_resume
from visionrl.orchestrate.step_log import rollout_samples
from visionrl.orchestrate.workers import Workers
from visionrl.rewards import RewardResult
from visionrl.rewards.merge import merge_results
from visionrl.rollout.scratch import remove_orphaned_scratch
from visionrl.run_layout import RunDir
from visionrl.train.learner import TrainBatch
from visionrl.types import Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path
    steps: int
    eval_accuracy: float | None
    history: list[dict[str, Any]]  # one dict of metrics per step (eval/accuracy None without eval data)


def train(cfg: JobConfig, resume: ResumeMode | None = None) -> TrainResult:
    """Run the job (`resume`, when given, overrides `cfg.resume`). A dead or stuck actor that cannot be
    restarted raises RunError naming it and the newest checkpoint; SIGTERM/SIGINT checkpoint the last
    completed step and raise Preempted."""
    run = RunDir.of(cfg.output_dir)
    mode = cfg.resume if resume is None else resume
    ckpt = checkpoint_to_resume(cfg, run, mode)  # refuses before anything starts
    prompts_in = PromptStream(cfg)  # data and processor first: bad paths fail in seconds, before Ray
    run.root.mkdir(parents=True, exist_ok=True)
    cfg = cfg.model_copy(update={"resume": mode})
    text = dump_config(cfg)  # what this run uses (overrides included)
    with storage_errors(run.config, len(text.encode())):  # a full disk: a clear error before anything starts
        atomic_write(run.config, text)
    if ckpt is None:
        run.history.unlink(missing_ok=True)
    with run_log(run):
        try:
            with ray_session(cfg.ray) as session, stop_on_signals():
                logger.info("ray session: %s", session)
                return _train(cfg, run, ckpt, prompts_in)
        except ActorProblem as problem:
            raise run_error(problem, run.root) from problem
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            raise run_error(err, run.root) from err
        finally:
            remove_orphaned_scratch()  # engines killed with the run could not remove their adapter copies


def _train(cfg: JobConfig, run: RunDir, ckpt: Path | None, prompts_in: PromptStream) -> TrainResult:
    G, spec, clock = cfg.algorithm.group_size, _sampling_spec(cfg), StepClock()
    # rollout.async_steps: the next step's batch, collected while the learner trains (orchestrate.pipeline)
    with MetricsWriter(run.tensorboard) as tb, Prefetch[Collected]() as prefetch:
        try:
            workers = Workers(*start_actors(cfg), cfg)
            # a non-zero adapter must change the engines' output
            workers.verify_delivery(prompts_in.probe_prompts())
        except Preempted as early_stop:  # stopped while starting: nothing new to save
            raise stopped(early_stop, run.root, None) from None
        warn_about_async_steps(cfg)
        watch = MismatchWatch(cfg.rollout.max_logprob_diff, cfg.rollout.max_logprob_diff_steps)
        start = saved = workers.resume(ckpt, prompts_in) if ckpt else 0
        history_file.trim(run.history, start)  # steps after the checkpoint will be run again
        tb.purge_from(start + 1)  # ... and shown once in TensorBoard (a fresh run: none of an earlier one)
        health = RunHealth(cfg.train.max_consecutive_skips)
        collapse = CollapseWatch(cfg.algorithm, cfg.train.target_accuracy)  # warns when exploration has died
        progress, acc, above = Progress(cfg.train.steps, start_step=start), None, 0
        history: list[dict[str, Any]] = []
        for step in range(start + 1, cfg.train.steps + 1):
            clock.start()
            got = prefetch.take(step)  # async: collected during the previous step's update
            position = prompts_in.sampler.state_dict()  # the data position after step - 1 (if got is None)
            try:
                # 1-3. sample prompts, roll out group_size completions each, reward them (see _collect)
                got = got or _collect(prompts_in, workers, _step_spec(spec, cfg, step), cfg, clock)
            except Preempted as signal_stop:
                # nothing of this step was applied: save the step before (if not yet), with its data position
                if step - 1 > saved:
                    saved = step - 1
                    workers.checkpoint(run.root, saved, prompts_in, sampler_state=position)
                raise stopped(signal_stop, run.root, saved if saved > start else None) from None
            if cfg.rollout.async_steps and step < cfg.train.steps and not _planned_save(step, cfg):
                # the engines generate and score step + 1's batch with the adapter they hold during the update
                collect = partial(_prefetched, prompts_in, workers, _step_spec(spec, cfg, step + 1), cfg)
                prefetch.start(step + 1, prompts_in.sampler.state_dict(), collect)
            prompts, completions, scores, rewards = got.prompts, got.completions, got.scores, got.rewards
            shaped, shaping = _shape_rewards(rewards, completions, cfg)  # DAPO overlong shaping, if set
            adv = group_advantages(shaped, G, scale=cfg.algorithm.advantage_scale)  # 4. advantages
            batch = _train_batch(prompts, completions, adv, got.keep, G, cfg.algorithm.mask_truncated)
            with clock("update"):  # 5. learner update
                stats = workers.update(batch) if batch.sequences else {}
            watch.check(step, stats.get(tags.LOGPROB_DIFF))  # the engine sampled the policy being trained
            with clock("rollout_wait"):  # async: the engines keep their version until the next batch is done
                prefetch.wait()
            with clock("sync"):  # 6. sync: the new adapter version to every engine (if there was an update)
                if stats:
                    workers.sync_adapter()
            m: dict[str, Any] = {
                **_step_metrics(rewards, completions, scores, stats, G, int(got.keep.sum())),
                **shaping,
                tags.SAMPLING_ROUNDS: float(got.rounds),
                tags.SKIPPED_PROMPTS: float(got.skipped),
                tags.ACTOR_RESTARTS: float(workers.restarts),
                **prompts_in.data_metrics(),
                **clock.metrics(),
                **got.timing,  # a prefetched batch's rollout and reward times
            }
            health.after_step(step, stats, scores)  # stops a run that trains on nothing
            eval_failed = None
            if step % cfg.logging.eval_every == 0 or step == cfg.train.steps:  # 7. log, maybe evaluate ...
                acc, eval_failed = _evaluate(workers, prompts_in, step)  # acc None: no eval data, or stopped
                m[tags.EVAL_ACCURACY] = acc
                above = above + 1 if acc is not None and acc >= (cfg.train.target_accuracy or 2.0) else 0
            collapse.after_step(step, m, acc)
            _log(tb, run, step, m, rewards, completions, prompts, scores, cfg)
            history.append({"step": step, **m})
            progress.update(step, reward=m[tags.REWARD_MEAN], acc=acc)
            stop = above >= 2  # two consecutive evals at the target (evals swing, docs/ENGINE_NOTES.md)
            signum = preemption.requested()
            # ... maybe checkpoint (also if eval failed); a prefetched batch is drawn again after a resume
            if _planned_save(step, cfg) or stop or signum or eval_failed:
                workers.checkpoint(run.root, step, prompts_in, sampler_state=prefetch.position)
                saved = step
            if signum:
                raise stopped(Preempted(signum), run.root, step)
            if eval_failed:
                raise eval_failed
            if stop:
                break
        progress.close()
        health.finish()  # no final adapter from a run that never applied an update
        adapter_dir = workers.export_final(run.root, acc)  # end: the adapter, with its manifest
        workers.close()
    return TrainResult(run.root, adapter_dir, history[-1]["step"] if history else start, acc, history)


def _evaluate(workers: Workers, prompts_in: PromptStream, step: int) -> tuple[float | None, RunError | None]:
    """Held-out accuracy, or (None, the error to raise once the step is checkpointed) when evaluation failed: a
    failed evaluation must not cost the step's update, or a resumed run could never get past this step. A stop
    request during it skips it (the step is checkpointed without it)."""
    try:
        return workers.evaluate(prompts_in.eval_prompts()), None
    except Preempted:
        return None, None
    except (ray.exceptions.RayError, RunError, ActorProblem) as err:  # ActorProblem: an engine past restarts
        cause = getattr(err, "cause", None) or err
        return None, RunError(
            f"the evaluation at step {step} failed: {type(cause).__name__}: {first_line(cause)}\nstep {step} "
            "was checkpointed first; fix the cause and continue with `visionrl train CONFIG --resume`"
        )


class MismatchWatch:
    """Stops a run whose engines do not sample the policy being trained: the mean |engine - learner| log-prob
    of the same tokens under the same adapter version over `limit` for `steps` steps in a row."""

    def __init__(self, limit: float, steps: int) -> None:
        self.limit, self.steps, self.over = limit, steps, 0

    def check(self, step: int, diff: float | None) -> None:
        if diff is None:
            return
        self.over = self.over + 1 if diff > self.limit else 0
        if self.over == 0:
            return
        what = (
            f"step {step}: the engine's sampling log-probs differ from the learner's by {diff:.3g} per token "
            f"(mean |difference|, same tokens and adapter version), over rollout.max_logprob_diff={self.limit}"
        )
        if self.over < self.steps:
            logger.warning("%s (%d of %d steps in a row allowed)", what, self.over, self.steps)
            return
        raise RunError(
            f"{what} for {self.over} steps in a row: the engines are not sampling the policy being trained, so "
            "the updates are off-policy by an unknown amount. Likely causes: adapter syncs that do not reach the "
            "engine (look for LoRA warnings in the engine log), an engine dtype or kernel far from the learner's, "
            "or sampling settings that differ (temperature). If the gap is expected, raise rollout.max_logprob_diff"
        )


class StepClock:
    """Wall time of each phase of a step, as `timing/<phase>_s`, plus the whole step and tokens per second."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._times: dict[str, float] = {}
        self._phase = ""

    def start(self) -> None:
        self._t0, self._times = time.perf_counter(), {}

    def __call__(self, phase: str) -> StepClock:
        self._phase = phase
        return self

    def __enter__(self) -> None:  # a phase may run several times in a step: times add up
        self._times[self._phase] = self._times.get(self._phase, 0.0) - time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._times[self._phase] += time.perf_counter()

    def metrics(self) -> dict[str, float]:
        out = {tags.timing_tag(k): v for k, v in self._times.items()}
        out[tags.TIMING_STEP] = time.perf_counter() - self._t0
        return out


# ---------------------------------------------------------------------------------------------- helpers


def _planned_save(step: int, cfg: JobConfig) -> bool:
    return step % cfg.logging.save_every == 0 or step == cfg.train.steps


def _step_spec(spec: SamplingSpec, cfg: JobConfig, step: int) -> SamplingSpec:
    return replace(spec, seed=cfg.train.seed * 100_003 + step)  # reproducible, distinct per step


def _sampling_spec(cfg: JobConfig) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(
        n=cfg.algorithm.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens
    )


@dataclass
class Collected:
    """The rollouts of one step: groups in order, their scores, and which groups the update uses."""

    prompts: list[PromptItem]
    completions: list[list[Completion]]
    scores: RewardResult
    rewards: torch.Tensor  # [num_groups * group_size]
    keep: torch.Tensor  # [num_groups] bool
    rounds: int
    skipped: int = 0  # prompts the engines rejected (left out of the step, never failing it)
    # rollout and reward times when collected ahead (async), else in the step's own clock
    timing: dict[str, float] = field(default_factory=dict)


MAX_REJECTED_BATCHES = 3  # batches in a row whose every prompt the engines rejected before the run stops


def _collect(
    prompts_in: PromptStream, workers: Workers, spec: SamplingSpec, cfg: JobConfig, clock: StepClock
) -> Collected:
    """Phases 1-3 of a step. Without dynamic sampling: one batch of prompts, every group kept. With it (DAPO):
    only groups whose rewards differ are kept, and further batches are sampled (at most max_sampling_rounds)
    until prompts_per_step such groups are found; surplus groups are dropped. Metrics cover every sampled group.
    Prompts an engine rejects (no completions) are left out and counted; a batch that loses every prompt
    is replaced by the next one, up to MAX_REJECTED_BATCHES in a row."""
    G, want = cfg.algorithm.group_size, cfg.rollout.prompts_per_step
    rounds_max = cfg.algorithm.max_sampling_rounds if cfg.algorithm.dynamic_sampling else 1
    prompts: list[PromptItem] = []
    completions: list[list[Completion]] = []
    parts: list[RewardResult] = []
    keep: list[bool] = []
    skipped = empty = r = 0
    while r < rounds_max:
        batch = prompts_in.next_batch()  # 1. sample prompts
        with clock("rollout"):  # 2. rollout with the current adapter
            groups = workers.rollout(batch, replace(spec, seed=None if spec.seed is None else spec.seed + r))
        batch, groups, rejected = _without_rejected(batch, groups)
        skipped += rejected
        if not batch:
            empty += 1
            if empty >= MAX_REJECTED_BATCHES:
                raise RunError(
                    f"the engines rejected every prompt of {empty} batches in a row (see the warnings above for "
                    "why); check rollout.max_model_len and data.max_pixels against your data"
                )
            continue
        empty, r = 0, r + 1
        with clock("reward"):  # 3. reward
            scores = workers.score(batch, groups)
        rewards = torch.tensor(scores.total, dtype=torch.float32)
        signal = (
            groups_with_signal(rewards, G)
            if cfg.algorithm.dynamic_sampling
            else torch.ones(len(batch), dtype=torch.bool)
        )
        for ok in signal.tolist():
            keep.append(ok and sum(keep) < want)
        prompts += batch
        completions += groups
        parts.append(scores)
        if sum(keep) >= want:
            break
    scores = merge_results(parts)
    return Collected(
        prompts,
        completions,
        scores,
        torch.tensor(scores.total, dtype=torch.float32),
        torch.tensor(keep, dtype=torch.bool),
        r,
        skipped,
    )


def _prefetched(prompts_in: PromptStream, workers: Workers, spec: SamplingSpec, cfg: JobConfig) -> Collected:
    """`_collect` run ahead (rollout.async_steps), timed by its own clock: the step's clock is not running yet."""
    clock = StepClock()
    got = _collect(prompts_in, workers, spec, cfg, clock)
    got.timing = {k: v for k, v in clock.metrics().items() if k != tags.TIMING_STEP}
    return got


def _without_rejected(
    batch: list[PromptItem], groups: list[list[Completion]]
) -> tuple[list[PromptItem], list[list[Completion]], int]:
    """The prompts that got completions, their groups, and how many prompts the engines rejected."""
    kept = [i for i, group in enumerate(groups) if group]
    return [batch[i] for i in kept], [groups[i] for i in kept], len(batch) - len(kept)


def _train_batch(
    prompts: list[PromptItem],
    completions: list[list[Completion]],
    adv: torch.Tensor,
    keep: torch.Tensor,
    G: int,
    mask_truncated: bool = False,
) -> TrainBatch:
    """Flatten the kept groups into sequences (each names its prompt); with `mask_truncated` the completions cut
    at max_new_tokens stay out of the loss (their rewards already counted in the group's advantages)."""
    seqs = [
        Sequence(
            prompt=i,
            completion_ids=c.token_ids,
            advantage=float(adv[i * G + j]),
            sampling_logprobs=c.logprobs,
            adapter_version=c.adapter_version,
        )
        for i, group in enumerate(completions)
        if keep[i]
        for j, c in enumerate(group)
        if not (mask_truncated and c.truncated)
    ]
    return TrainBatch(prompts=prompts, sequences=seqs)


def _shape_rewards(
    rewards: torch.Tensor, completions: list[list[Completion]], cfg: JobConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards for the advantages: plus DAPO's overlong penalty when `algorithm.overlong_buffer` is set; and how
    many completions the overlong penalty and `mask_truncated` touched."""
    algo, flat = cfg.algorithm, [c for group in completions for c in group]
    m = {tags.TRUNCATED_MASKED: float(sum(c.truncated for c in flat)) if algo.mask_truncated else 0.0}
    if algo.overlong_buffer is None:
        return rewards, {**m, tags.OVERLONG_PENALIZED: 0.0}
    lengths = torch.tensor([len(c.token_ids) for c in flat], dtype=torch.float32)
    penalty = overlong_penalty(
        lengths, cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_factor
    )
    m[tags.OVERLONG_PENALIZED] = float((penalty < 0).sum())
    m[tags.OVERLONG_PENALTY_MEAN] = float(penalty.mean())
    return rewards + penalty, m


def _step_metrics(
    rewards: torch.Tensor,
    completions: list[list[Completion]],
    scores: RewardResult,
    stats: dict[str, float],
    G: int,
    n_kept: int,
) -> dict[str, float]:
    flat = [c for group in completions for c in group]
    lengths = torch.tensor([len(c.token_ids) for c in flat], dtype=torch.float32)
    gs = group_stats(rewards, G)
    m: dict[str, float] = {
        tags.REWARD_MEAN: float(rewards.mean()),
        tags.REWARD_STD: float(rewards.std(unbiased=False)),
        tags.ZERO_STD_FRACTION: float(gs["zero_std_fraction"]),
        tags.GROUPS_WITH_SIGNAL: 1.0 - float(gs["zero_std_fraction"]),
        tags.REWARD_ERRORS: float(sum(scores.num_errors.values())),
        tags.REWARD_TIMEOUTS: float(sum(scores.num_timeouts.values())),
        tags.LENGTH_MEAN: float(lengths.mean()),
        tags.LENGTH_MAX: float(lengths.max()),
        tags.TRUNCATED_FRACTION: sum(c.truncated for c in flat) / len(flat),
        tags.RESPONSE_TOKENS: float(lengths.sum()),
        tags.GROUPS_KEPT: float(n_kept),
        tags.ADAPTER_VERSION: float(flat[0].adapter_version),
    }
    for name, values in scores.per_reward.items():
        m[tags.reward_component_tag(name)] = sum(values) / len(values)
    for k, v in stats.items():
        if "/" in k:  # the learner's tags (metrics.py); plain keys are its internal counters
            m[k] = float(v)
    m.setdefault(tags.LOSS_POLICY, 0.0)
    m.setdefault(tags.LOSS_KL, 0.0)
    m.setdefault(tags.SKIPPED_UPDATES, 0.0)
    return m


def _log(
    tb: MetricsWriter,
    run: RunDir,
    step: int,
    m: dict[str, Any],
    rewards: torch.Tensor,
    completions: list[list[Completion]],
    prompts: list[PromptItem],
    scores: RewardResult,
    cfg: JobConfig,
) -> None:
    m[tags.THROUGHPUT] = m[tags.RESPONSE_TOKENS] / max(m[tags.TIMING_STEP], 1e-9)
    history_file.append(run.history, {"step": step, **m})  # every step: a killed run keeps its history
    try:
        if step % cfg.logging.log_every == 0:
            tb.scalars(step, m)
            tb.histogram(step, tags.REWARD_HIST, rewards)
            tb.histogram(step, tags.LENGTH_HIST, [len(c.token_ids) for g in completions for c in g])
        if step % cfg.logging.images_every == 0 or step == 1:
            samples = rollout_samples(prompts, completions, scores.total, cfg.logging.num_images)
            tb.rollout_images(step, samples)
            tb.rollout_table(step, samples)
        tb.flush()
    except StorageError as err:  # TensorBoard's disk is full: this step is not checkpointed, say what is
        raise StorageError(f"{err}\n{resume_hint(run.root)}") from None
