"""The GRPO loop. One step = the numbered phases of DESIGN.md, each one call; the helpers are below the loop.

1 sample prompts   2 rollout   3 reward   4 advantages   5 learner update   6 sync adapter   7 log/eval/save
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from visionrl.algo import group_advantages, group_stats, groups_with_signal
from visionrl.config import JobConfig, dump_config
from visionrl.orchestrate.actors import ray_session, start_actors
from visionrl.orchestrate.workers import PromptStream, Workers, rollout_samples
from visionrl.rollout.types import SamplingSpec
from visionrl.train.batching import Sequence
from visionrl.train.learner import TrainBatch

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    output_dir: Path
    adapter_dir: Path
    steps: int
    eval_accuracy: float | None
    history: list[dict[str, float]]


def train(cfg: JobConfig, resume: bool = False) -> TrainResult:
    from visionrl.metrics import MetricsWriter, Progress

    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    G, spec = cfg.algorithm.group_size, _sampling_spec(cfg)
    with ray_session(cfg.ray), MetricsWriter(run / "tensorboard") as tb:
        workers = Workers(*start_actors(cfg), cfg)
        prompts_in = PromptStream(cfg)
        start = workers.resume(run, prompts_in) if resume else 0
        progress, history, acc, above = Progress(cfg.train.steps, start_step=start), [], None, 0
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            prompts = prompts_in.next_batch()  # 1. sample prompts
            completions = workers.rollout(
                prompts, replace(spec, seed=cfg.train.seed * 100_003 + step)
            )  # 2. rollout
            t1 = time.perf_counter()
            scores = workers.score(prompts, completions)  # 3. reward
            rewards = torch.tensor(scores.total, dtype=torch.float32)
            adv = group_advantages(rewards, G, scale=cfg.algorithm.advantage_scale)  # 4. advantages
            batch = _train_batch(prompts, completions, adv, rewards, cfg)
            t2 = time.perf_counter()
            stats = workers.update(batch) if batch.sequences else {}  # 5. learner update
            t3 = time.perf_counter()
            workers.sync_adapter()  # 6. sync: new adapter version to every engine
            t4 = time.perf_counter()
            m = _step_metrics(rewards, completions, scores, stats, G, cfg, len(batch.sequences))  # 7. log ...
            m.update(
                {
                    "timing/rollout_s": t1 - t0,
                    "timing/reward_s": t2 - t1,
                    "timing/update_s": t3 - t2,
                    "timing/sync_s": t4 - t3,
                    "timing/step_s": t4 - t0,
                    "throughput/tokens_per_s": m["response/tokens"] / max(t4 - t0, 1e-9),
                }
            )
            if step % cfg.logging.eval_every == 0 or step == cfg.train.steps:  # ... maybe evaluate ...
                acc = workers.evaluate(prompts_in.eval_prompts())
                m["eval/accuracy"] = acc
                above = above + 1 if acc is not None and acc >= (cfg.train.target_accuracy or 2.0) else 0
            _log(tb, step, m, rewards, completions, prompts, scores, cfg)
            history.append({"step": step, **m})
            progress.update(step, reward=m["reward/mean"], acc=acc)
            stop = above >= 2
            if step % cfg.logging.save_every == 0 or step == cfg.train.steps or stop:  # ... maybe checkpoint
                workers.checkpoint(run, step, prompts_in)
            if stop:  # two consecutive evals at the target: done (evals swing, FACTS.md)
                break
        progress.close()
        adapter_dir = workers.export_final(run, acc)  # end: the adapter, with its manifest
        workers.close()
    (run / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    return TrainResult(run, adapter_dir, history[-1]["step"] if history else start, acc, history)


# ---------------------------------------------------------------------------------------------- helpers


def _sampling_spec(cfg: JobConfig) -> SamplingSpec:
    r = cfg.rollout
    return SamplingSpec(
        n=cfg.algorithm.group_size, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_new_tokens
    )


def _train_batch(
    prompts, completions, adv: torch.Tensor, rewards: torch.Tensor, cfg: JobConfig
) -> TrainBatch:  # noqa: ANN001
    """Flatten groups into sequences; with dynamic sampling (DAPO) drop groups whose rewards are all equal."""
    G = cfg.algorithm.group_size
    keep = (
        groups_with_signal(rewards, G)
        if cfg.algorithm.dynamic_sampling
        else torch.ones(len(prompts), dtype=torch.bool)
    )
    seqs = []
    for i, group in enumerate(completions):
        if not keep[i]:
            continue
        for j, c in enumerate(group):
            seqs.append(
                Sequence(
                    prompt=i,
                    completion_ids=c.token_ids,
                    advantage=float(adv[i * G + j]),
                    sampling_logprobs=c.logprobs,
                )
            )
    return TrainBatch(prompts=prompts, sequences=seqs)


def _step_metrics(
    rewards, completions, scores, stats: dict, G: int, cfg: JobConfig, n_kept: int
) -> dict[str, float]:  # noqa: ANN001
    flat = [c for group in completions for c in group]
    lengths = torch.tensor([len(c.token_ids) for c in flat], dtype=torch.float32)
    gs = group_stats(rewards, G)
    m: dict[str, float] = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/zero_std_fraction": float(gs["zero_std_fraction"]),
        "reward/errors": float(sum(scores.num_errors.values())),
        "reward/timeouts": float(sum(scores.num_timeouts.values())),
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/truncated_fraction": sum(c.truncated for c in flat) / len(flat),
        "response/tokens": float(lengths.sum()),
        "rollout/groups_kept": n_kept / G,
        "rollout/adapter_version": float(flat[0].adapter_version),
    }
    for name, values in scores.per_reward.items():
        m[f"reward/component/{name}"] = sum(values) / len(values)
    for k, v in stats.items():
        if "/" in k:
            m[k] = float(v)
    m.setdefault("loss/policy", 0.0)
    m.setdefault("loss/kl", 0.0)
    return m


def _log(tb, step: int, m: dict, rewards, completions, prompts, scores, cfg: JobConfig) -> None:  # noqa: ANN001
    if step % cfg.logging.log_every == 0:
        tb.scalars(step, m)
        tb.histogram(step, "reward/hist", rewards)
        tb.histogram(step, "response/length_hist", [len(c.token_ids) for g in completions for c in g])
    if step % cfg.logging.images_every == 0 or step == 1:
        samples = rollout_samples(prompts, completions, scores.total, cfg.logging.num_images)
        tb.rollout_images(step, samples)
        tb.rollout_table(step, samples)
    tb.flush()
