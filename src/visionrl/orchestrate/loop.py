"""The GRPO loop: `train` runs a job, and `Loop.step` is one step on one screen, its phases numbered in order.

1 sample prompts   2 rollout   3 reward   4 advantages   5 learner update   6 sync adapter   7 log/eval/save

Which GRPO this is:
- Sampled: each step draws rollout.prompts_per_step training prompts (a seeded, resumable sampler) and the
  rollout engines generate algorithm.group_size completions for each, sampling with the adapter version they
  hold: the learner's current one (with rollout.async_steps: 1 the one before it). With
  algorithm.dynamic_sampling (DAPO) groups whose rewards are all equal are dropped and further prompts drawn,
  at most algorithm.max_sampling_rounds batches.
- Scored: the weighted sum of the job's rewards, on the reward workers; optionally DAPO's overlong penalty
  (algorithm.overlong_buffer).
- Normalised: group-relative advantages, each reward minus its group's mean, divided by the group's std
  (advantage_scale: std, GRPO) or not (none, Dr. GRPO); a group of equal rewards has advantage 0.
- Clipped: the policy loss algorithm.loss against the old policy (algorithm.old_logprobs: the learner's own
  log-probs before the update, or the engine's sampling log-probs): PPO's token ratio clipped to
  [1 - clip_low, 1 + clip_high] (dual_clip for negative advantages), GSPO's sequence ratio clipped, CISPO's
  clipped ratio as a stop-gradient weight, SAPO's soft gate; with rollout-correction weights for the
  engine/learner mismatch, a KL penalty to the base model (kl_coef) and an entropy bonus (entropy_coef), over
  algorithm.updates_per_batch optimizer steps. Only the LoRA adapter trains (`train.learner`).
- Synced: after the update, the adapter alone (its LoRA weights, no base weights) goes through Ray's object
  store to every engine, under the learner's version, which is new each step whose update was applied (a
  vLLM LoRA id is never reused for other weights).
- When: synchronously by default: step s samples with version s - 1 and trains it into version s, which every
  engine holds before step s + 1 samples. With rollout.async_steps: 1 phases 1-3 of step s + 1 run during
  phase 5 of step s, with version s - 1: one step off-policy, never more (`orchestrate.pipeline` says how).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import ray
import torch

from visionrl import history as history_file
from visionrl import metrics as tags
from visionrl.algo import group_advantages, overlong_penalty
from visionrl.config import JobConfig, dump_config
from visionrl.envs.registry import check_env
from visionrl.errors import InputError, Preempted, RunError, storage_errors
from visionrl.files import atomic_write
from visionrl.judge.scoring import judge_entries
from visionrl.metrics import Progress
from visionrl.models.sequences import Sequence
from visionrl.orchestrate import console, preemption
from visionrl.orchestrate.actors import start_actors
from visionrl.orchestrate.collect import Collected, collect, collect_ahead
from visionrl.orchestrate.delivery import FingerprintWatch, MismatchWatch
from visionrl.orchestrate.failures import run_error, run_log, stopped
from visionrl.orchestrate.health import CollapseWatch, RunHealth
from visionrl.orchestrate.pipeline import Prefetch, warn_about_async_steps
from visionrl.orchestrate.preemption import stop_on_signals
from visionrl.orchestrate.prompt_stream import PromptStream
from visionrl.orchestrate.ray_session import ray_session
from visionrl.orchestrate.remote import ActorProblem, first_line
from visionrl.orchestrate.resume import ResumeMode, checkpoint_to_resume
from visionrl.orchestrate.scheduling import check_gpu_requests
from visionrl.orchestrate.step_log import StepClock, step_metrics, write_step
from visionrl.orchestrate.workers import Synced, Workers
from visionrl.rollout.scratch import remove_orphaned_scratch
from visionrl.run_layout import RunDir
from visionrl.trackers import RunTrackers, open_trackers
from visionrl.train.learner import TrainBatch
from visionrl.types import Completion, SamplingSpec

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
    called_at = time.perf_counter()  # the start-up's clock (timing/startup_s, logged with the first step)
    run = RunDir.of(cfg.output_dir)
    mode = cfg.resume if resume is None else resume
    ckpt = checkpoint_to_resume(cfg, run, mode)  # refuses before anything starts
    prompts_in = PromptStream(cfg)  # data and processor first: bad paths fail in seconds, before Ray
    if cfg.env is not None:
        check_env(cfg.env)  # the environment's class or tools import and build, before Ray
    if run.root.exists() and not run.root.is_dir():
        raise InputError(
            f"output_dir {run.root} is a file, not a folder; point output_dir at a folder (new or a run's)"
        )
    with storage_errors(run.root, None):  # a read-only or missing mount: what, and what to do
        run.root.mkdir(parents=True, exist_ok=True)
    cfg = cfg.model_copy(update={"resume": mode})
    text = dump_config(cfg)  # what this run uses (overrides included)
    with storage_errors(run.config, len(text.encode())):  # a full disk: a clear error before anything starts
        atomic_write(run.config, text)
    if ckpt is None:
        run.history.unlink(missing_ok=True)
    with run_log(run), console.libraries_to(run.libraries_log):
        try:
            with ray_session(cfg.ray) as session, stop_on_signals():
                logger.debug("ray session: %s", session)
                check_gpu_requests(cfg, session["mode"])  # before any actor waits for a GPU that never comes
                return _train(cfg, run, ckpt, prompts_in, called_at)
        except ActorProblem as problem:
            raise run_error(problem, run.root) from problem
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
            raise run_error(err, run.root) from err
        finally:
            remove_orphaned_scratch()  # engines killed with the run could not remove their adapter copies


def _train(
    cfg: JobConfig, run: RunDir, ckpt: Path | None, prompts_in: PromptStream, called_at: float
) -> TrainResult:
    # rollout.async_steps: the next step's batch, collected while the learner trains (orchestrate.pipeline)
    with console.children_to_log():  # W&B's service process writes to the libraries' log
        trackers = open_trackers(cfg, run, resumed=ckpt is not None)
    with trackers as tb, Prefetch[Collected]() as prefetch:
        workers, startup = _start_workers(cfg, run, prompts_in)
        try:
            resumed = _resume(cfg, run, ckpt, prompts_in, tb, workers)
            loop = Loop(cfg, run, prompts_in, workers, tb, prefetch, resumed)
            loop.startup = Startup(called_at, startup)
            for step in range(resumed + 1, cfg.train.steps + 1):
                first = step == resumed + 1
                what = f"step {step}, the first of this run (the engines' kernels warm up)"
                with console.phase(what, "done") if first else contextlib.nullcontext():
                    at_target = loop.step(step)
                if at_target:
                    break  # two evaluations in a row at the target
            return loop.finish()
        except BaseException:
            # a failed or stopped run leaves no actor behind, also on a Ray that outlives it (attached, or
            # already running in this process), where a handle kept by a traceback would keep them alive
            workers.kill()
            raise


def _start_workers(cfg: JobConfig, run: RunDir, prompts_in: PromptStream) -> tuple[Workers, dict[str, float]]:
    """The actors started (`start_actors` stops those it started if one fails), and the adapter seen to reach
    the engines; with the seconds each took (start-up metrics)."""
    t = time.perf_counter()
    try:
        with console.phase(_starting(cfg)):
            workers = Workers(*start_actors(cfg), cfg)
    except Preempted as early_stop:  # stopped while starting: nothing new to save
        raise stopped(early_stop, run.root, None) from None
    started, t = time.perf_counter() - t, time.perf_counter()
    try:
        with console.phase("checking that the adapter reaches the engines", "verified"):
            workers.verify_delivery(prompts_in.probe_prompts())  # a non-zero adapter must change their output
        seconds = {tags.TIMING_START_ACTORS: started, tags.TIMING_DELIVERY_CHECK: time.perf_counter() - t}
        if judge_entries(cfg):
            with console.phase("starting the judges"):
                workers.attach_judges(prompts_in.processor)  # a job's `judge` rewards, their actors started
        if cfg.env is not None:
            with console.phase(f"starting {cfg.env.num_workers} env worker(s) ({cfg.env.name})"):
                workers.attach_envs(prompts_in.processor)  # multi-turn episodes (orchestrate.episodes)
    except BaseException as err:
        workers.kill()
        if isinstance(err, Preempted):
            raise stopped(err, run.root, None) from None
        raise
    return workers, seconds


def _starting(cfg: JobConfig) -> str:
    """The start-up phase's line: what loads (the learner and engines load the model; vLLM compiles)."""
    plan = cfg.placement_plan()
    ranks, engines = len(plan.learners), len(plan.engines)
    return (
        f"starting {ranks} learner rank(s) and {engines} rollout engine(s) ({cfg.rollout.engine}): loading "
        f"{cfg.model.path}" + (", vLLM compiling" if cfg.rollout.engine == "vllm" else "")
    )


def _resume(
    cfg: JobConfig,
    run: RunDir,
    ckpt: Path | None,
    prompts_in: PromptStream,
    tb: RunTrackers,
    workers: Workers,
) -> int:
    """The run resumed from `ckpt` if given; returns the step resumed from (0: a fresh run)."""
    warn_about_async_steps(cfg)
    resumed = workers.resume(ckpt, prompts_in) if ckpt else 0
    history_file.trim(run.history, resumed)  # steps after the checkpoint will be run again
    tb.purge_from(resumed + 1)  # ... and shown once in TensorBoard (a fresh run: none of an earlier one)
    return resumed


@dataclass
class Startup:
    """When `train` was called, and the seconds of the start-up's parts: logged with the run's first step."""

    called_at: float
    parts: dict[str, float]

    def metrics(self) -> dict[str, float]:
        return {tags.TIMING_STARTUP: time.perf_counter() - self.called_at, **self.parts}


class Loop:
    """The run between its steps (the actors behind `workers`, the data position, the watches, the evaluations
    so far, the newest checkpointed step) and one GRPO step, `step`."""

    def __init__(
        self,
        cfg: JobConfig,
        run: RunDir,
        prompts_in: PromptStream,
        workers: Workers,
        tb: RunTrackers,
        prefetch: Prefetch[Collected],
        resumed: int,
    ) -> None:
        self.cfg, self.run, self.prompts_in, self.workers = cfg, run, prompts_in, workers
        self.tb, self.prefetch = tb, prefetch
        self.G, self.spec, self.clock = cfg.algorithm.group_size, _sampling_spec(cfg), StepClock()
        self.resumed = self.saved = resumed  # the step resumed from (0: none); the newest checkpointed step
        r = cfg.rollout  # the engines sample the policy being trained (orchestrate.delivery)
        self.mismatch = MismatchWatch(r.max_logprob_diff, r.max_logprob_diff_steps, r.max_logprob_diff_ratio)
        self.fingerprints = FingerprintWatch(
            r.num_engines, r.max_logprob_diff, r.max_logprob_diff_steps, r.max_logprob_diff_ratio
        )
        self.health = RunHealth(cfg.train.max_consecutive_skips)
        # warns when exploration has died (entropy and groups with signal near zero below the target)
        self.collapse = CollapseWatch(cfg.algorithm, cfg.train.target_accuracy)
        self.progress = Progress(cfg.train.steps, start_step=resumed)
        # the latest held-out accuracy (None: no eval data, or it failed) and the evaluations in a row at
        # train.target_accuracy, carried over from the steps before a resume (its history file)
        self.acc, self.above = (
            evaluations_so_far(run.history, cfg.train.target_accuracy) if resumed else (None, 0)
        )
        self.history: list[dict[str, Any]] = []
        self.startup: Startup | None = None  # set by `train`; logged with the first step, then None

    def step(self, step: int) -> bool:
        """One GRPO step, phases in order; True when the run should stop (two evaluations at the target)."""
        cfg, G, clock = self.cfg, self.G, self.clock
        startup, self.startup = (self.startup.metrics() if self.startup else {}), None
        clock.start()
        got = self._collected(step)  # 1-3. sample prompts, roll out group_size completions each, reward them
        self._prefetch_next(step)  # async: step + 1's batch, sampled during this update with the adapter held
        shaped, shaping = _shape_rewards(got.rewards, got.completions, cfg)  # DAPO overlong shaping, if set
        adv = group_advantages(
            shaped, G, scale=cfg.algorithm.advantage_scale, eps=cfg.algorithm.advantage_std_eps
        )  # 4.
        batch = _train_batch(got, adv, G, cfg.algorithm.mask_truncated)
        with clock("update"):  # 5. learner update
            stats = self.workers.update(batch) if batch.sequences else {}
        self.mismatch.check(step, stats.get(tags.LOGPROB_DIFF))  # the engine sampled the policy being trained
        with clock("rollout_wait"):  # async: the engines keep their version until the next batch is done
            self.prefetch.wait()
        with clock("sync"):  # 6. sync: the new adapter version to every engine (if there was an update)
            synced = self.workers.sync_adapter() if stats else None
        if synced:  # each engine's fingerprint under the version just synced
            self.fingerprints.check(step, synced.version, synced.fingerprint_diffs)
        m = {**self._metrics(got, stats, shaping, synced), **startup}
        self.health.after_step(step, stats, got.scores)  # stops a run that trains on nothing
        return self._log_evaluate_save(step, got, m)  # 7. log, maybe evaluate, maybe checkpoint

    def _collected(self, step: int) -> Collected:
        """Phases 1-3 of `step`: the batch collected during the step before (async), or collected now. A stop
        request while collecting checkpoints the step before (if not yet) and raises Preempted."""
        got = self.prefetch.take(step)
        position = self.prompts_in.sampler.state_dict()  # the data position after step - 1 (if got is None)
        try:
            return got or collect(self.prompts_in, self.workers, self._spec(step), self.cfg, self.clock)
        except Preempted as signal_stop:
            # nothing of this step was applied: save the step before (if not yet), with its data position
            if step - 1 > self.saved:
                self.saved = step - 1
                self.workers.checkpoint(self.run.root, self.saved, self.prompts_in, sampler_state=position)
            saved = self.saved if self.saved > self.resumed else None
            raise stopped(signal_stop, self.run.root, saved) from None

    def _prefetch_next(self, step: int) -> None:
        """With rollout.async_steps: start collecting step + 1's batch, unless this step is the last or saves
        a checkpoint (the next batch is then sampled with the checkpoint's adapter, as after a resume)."""
        cfg = self.cfg
        if cfg.rollout.async_steps and step < cfg.train.steps and not _planned_save(step, cfg):
            # the engines generate and score step + 1's batch with the adapter they hold during the update
            collect = partial(collect_ahead, self.prompts_in, self.workers, self._spec(step + 1), cfg)
            self.prefetch.start(step + 1, self.prompts_in.sampler.state_dict(), collect)

    def _spec(self, step: int) -> SamplingSpec:
        """The sampling settings of `step`: its seed reproducible, and distinct per step."""
        return replace(self.spec, seed=self.cfg.train.seed * 100_003 + step)

    def _metrics(
        self, got: Collected, stats: dict[str, float], shaping: dict[str, float], synced: Synced | None
    ) -> dict[str, Any]:
        fingerprint = (
            {tags.FINGERPRINT_DIFF: max(synced.fingerprint_diffs), tags.TIMING_SYNC_LOAD: synced.load_s,
             tags.TIMING_SYNC_CHECK: synced.check_s,
             **{tags.timing_tag(f"sync_{part}"): s for part, s in synced.parts.items()}}
            if synced else {}
        )  # fmt: skip
        return {
            **fingerprint,
            **step_metrics(got.rewards, got.completions, got.scores, stats, self.G, int(got.keep.sum())),
            **shaping,
            tags.SAMPLING_ROUNDS: float(got.rounds),
            tags.SKIPPED_PROMPTS: float(got.skipped),
            tags.ACTOR_RESTARTS: float(self.workers.restarts),
            **self.prompts_in.data_metrics(),
            **self.clock.metrics(),
            **got.timing,  # a prefetched batch's rollout and reward times
            **got.episode_metrics,  # multi-turn episodes
        }

    def _log_evaluate_save(self, step: int, got: Collected, m: dict[str, Any]) -> bool:
        """Phase 7: evaluate when due, write the step (history, TensorBoard), checkpoint when due, at the early
        stop, when a stop was requested or the evaluation failed (then raise); True at the early stop."""
        cfg, eval_failed = self.cfg, None
        if step % cfg.logging.eval_every == 0 or step == cfg.train.steps:
            # acc None: no eval data, or stopped; eval_failed: raised once the step is checkpointed
            self.acc, eval_failed = _evaluate(self.workers, self.prompts_in, step)
            m[tags.EVAL_ACCURACY] = self.acc
            at_target = self.acc is not None and self.acc >= (cfg.train.target_accuracy or 2.0)
            self.above = self.above + 1 if at_target else 0
        self.collapse.after_step(step, m, self.acc)
        write_step(self.tb, self.run, step, m, got.prompts, got.completions, got.scores, got.rewards, cfg)
        self.history.append({"step": step, **m})
        self.progress.update(step, reward=m[tags.REWARD_MEAN], acc=self.acc)
        stop = self.above >= 2  # two consecutive evals at the target (evals swing, docs/ENGINE_NOTES.md)
        signum = preemption.requested()
        if _planned_save(step, cfg) or stop or signum or eval_failed:  # a failed evaluation: checkpointed too
            position = self.prefetch.position  # a prefetched batch is drawn again after a resume
            self.workers.checkpoint(self.run.root, step, self.prompts_in, sampler_state=position)
            self.saved = step
        if signum:
            raise stopped(Preempted(signum), self.run.root, step)
        if eval_failed:
            raise eval_failed
        return stop

    def finish(self) -> TrainResult:
        """The end of the run: the final adapter exported, with its manifest, and the actors closed."""
        self.progress.close()
        self.health.finish()  # no final adapter from a run that never applied an update
        adapter_dir = self.workers.export_final(self.run.root, self.acc)
        self.workers.close()
        steps = self.history[-1]["step"] if self.history else self.resumed
        return TrainResult(self.run.root, adapter_dir, steps, self.acc, self.history)


def evaluations_so_far(history: Path, target: float | None) -> tuple[float | None, int]:
    """From a run's history file: the latest held-out accuracy, and how many evaluations in a row (the latest
    ones) were at `target` (the early stop needs two, also across a resume); a failed evaluation (None) ends a
    row, as it does in the run."""
    accuracies = [h[tags.EVAL_ACCURACY] for h in history_file.read(history) if tags.EVAL_ACCURACY in h]
    above = 0
    for acc in reversed(accuracies):
        if target is None or acc is None or acc < target:
            break
        above += 1
    return (accuracies[-1] if accuracies else None), above


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


# ---------------------------------------------------------------------------------------------- helpers


def _planned_save(step: int, cfg: JobConfig) -> bool:
    return step % cfg.logging.save_every == 0 or step == cfg.train.steps


def _sampling_spec(cfg: JobConfig) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(
        n=cfg.algorithm.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens
    )


def _train_batch(got: Collected, adv: torch.Tensor, G: int, mask_truncated: bool = False) -> TrainBatch:
    """Flatten the kept groups into sequences (each names its prompt); with `mask_truncated` the completions cut
    at max_new_tokens stay out of the loss (their rewards already counted in the group's advantages). Multi-turn
    episodes each bring their own prompt (their tokens, every image of the episode) and environment mask; an
    episode without a turn (its reset failed) has nothing to train."""
    prompts = list(got.prompts)
    seqs = []
    for i, group in enumerate(got.completions):
        if not got.keep[i]:
            continue
        for j, c in enumerate(group):
            if (mask_truncated and c.truncated) or (c.env_mask is not None and not c.token_ids):
                continue
            index = i
            if got.train_prompts is not None:  # an episode: its own prompt
                index = len(prompts)
                prompts.append(got.train_prompts[i][j])
            seqs.append(
                Sequence(
                    prompt=index,
                    completion_ids=c.token_ids,
                    advantage=float(adv[i * G + j]),
                    sampling_logprobs=c.logprobs,
                    adapter_version=c.adapter_version,
                    env_mask=c.env_mask,
                )
            )
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
