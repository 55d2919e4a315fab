"""What the loop calls: the prompt stream (data side) and `Workers`, the fan-out over Ray actors.

`Workers` hides how many engines and reward workers there are: prompts are split evenly over engines,
completions over reward workers, and every adapter version is put in the object store once and loaded by all
engines.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from visionrl import metrics as tags
from visionrl.config import JobConfig
from visionrl.data import PromptSampler, load_dataset
from visionrl.data.layouts import Layout
from visionrl.data.prompts import build_prompt
from visionrl.data.sampler import draw_samples
from visionrl.errors import RunError
from visionrl.models.loader import load_processor
from visionrl.pictures import RolloutSample
from visionrl.rewards import CombinedReward, RewardResult, build_reward_fn
from visionrl.run_layout import RunDir
from visionrl.train.learner import TrainBatch
from visionrl.types import Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)


class PromptStream:
    """Batches of chat-templated prompts from the training data, resumable; and the held-out prompts."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.processor = load_processor(cfg.model.path)
        d = cfg.data
        layout = Layout(prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key)
        self.train = load_dataset(d.train, on_bad_image=d.on_bad_image, layout=layout)
        self.sampler = PromptSampler(
            self.train, cfg.rollout.prompts_per_step, cfg.train.seed, balance_key=d.balance_key
        )
        self._eval_data = None
        if d.eval is not None:
            self._eval_data = load_dataset(
                d.eval, on_bad_image=d.on_bad_image, max_samples=d.max_eval_samples, layout=layout
            )
        self._eval: list[PromptItem] | None = None

    def next_batch(self) -> list[PromptItem]:
        return [self._prompt(s) for s in draw_samples(self.train, self.sampler)]

    def data_metrics(self) -> dict[str, float]:
        """Records skipped for bad images: at load, and mid-run so far (each replaced by another record)."""
        return {
            tags.DATA_SKIPPED_AT_LOAD: float(self.train.num_skipped),
            tags.DATA_SKIPPED_MIDRUN: float(len(self.sampler.excluded)),
        }

    def _prompt(self, sample: Any) -> PromptItem:
        return build_prompt(sample, self.processor, self.cfg.data.system_prompt)

    def probe_prompts(self, n: int = 4) -> list[PromptItem]:
        """A few training prompts for the start-up adapter probe; the sampler's position is not touched."""
        return [self._prompt(self.train[i]) for i in range(min(n, len(self.train)))]

    def eval_prompts(self) -> list[PromptItem]:
        if self._eval_data is None:
            return []
        if self._eval is None:
            self._eval = [self._prompt(s) for s in self._eval_data]
        return self._eval


PROBE_MIN_CHANGE = 1e-4  # a non-zero adapter moves a greedy log-prob by far more; 0 means it was not applied
ENGINE_SEED_STRIDE = 1_000_003  # engines draw from disjoint seed streams: no two samples share noise


def _engine_spec(spec: SamplingSpec, engine: int) -> SamplingSpec:
    return spec if spec.seed is None else replace(spec, seed=spec.seed + ENGINE_SEED_STRIDE * engine)


def _split(items: list, parts: int) -> list[list]:
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


class _RemoteEngine:
    """A Ray rollout actor seen as a plain engine (for the shared evaluation code)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        return ray.get(self.actor.generate.remote(prompts, spec))


class Workers:
    def __init__(self, learner: Any, engines: list[Any], rewards: list[Any], cfg: JobConfig) -> None:
        self.learner, self.engines, self.rewards, self.cfg = learner, engines, rewards, cfg
        self._eval_reward: CombinedReward | None = None

    # 2. rollout
    def rollout(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        chunks = _split(prompts, len(self.engines))
        refs = [
            e.generate.remote(c, _engine_spec(spec, i))
            for i, (e, c) in enumerate(zip(self.engines, chunks, strict=True))
            if c
        ]
        return [group for part in ray.get(refs) for group in part]

    # at start: the adapter reaches the engines
    def verify_delivery(self, prompts: list[PromptItem]) -> list[float]:
        """Every engine must change its output when given a non-zero adapter of this run's layout, else the run
        would train an adapter that rollouts never use. Returns each engine's largest log-prob change."""
        probe = self.learner.call.remote("probe_payload")
        changes = ray.get([e.probe.remote(probe, prompts) for e in self.engines])
        dead = [i for i, c in enumerate(changes) if c < PROBE_MIN_CHANGE]
        if dead:
            raise RunError(
                f"rollout engine(s) {dead} ignore the LoRA adapter: a random non-zero adapter of this run's layout "
                f"changed their greedy log-probs by at most {max(changes[i] for i in dead):.2g}. Rollouts would "
                "never sample from the policy being trained. Likely causes: LoRA targets the engine does not wrap "
                "(vLLM skips LoRA on the vision blocks; lora.target_modules), LoRA on the merger without "
                "vLLM's tower-connector LoRA (lora.train_merger must be set for the engine to enable it), or "
                "lora.rank above the engine's max_lora_rank"
            )
        # Serve the learner's own version as a real adapter right away: once vLLM has held a LoRA, requests
        # without one can still get its weights (docs/ENGINE_NOTES.md), so "no adapter" is never served again.
        self.sync_adapter()
        logger.info("adapter delivery verified: largest greedy log-prob change per engine %s", changes)
        return changes

    # 3. reward
    def score(self, prompts: list[PromptItem], completions: list[list[Completion]]) -> RewardResult:
        texts = [c.text for group in completions for c in group]
        records = [_reward_record(p) for p, group in zip(prompts, completions, strict=True) for _ in group]
        n = len(self.rewards)
        parts = ray.get(
            [
                w.score.remote(t, r)
                for w, t, r in zip(self.rewards, _split(texts, n), _split(records, n), strict=True)
                if t
            ]
        )
        return merge_results(parts)

    # 5. learner update
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """The learner's step; with `rollout.sleep_during_update` the engines sleep meanwhile (their GPU memory
        goes to the colocated learner) and are awake again before it returns."""
        sleep = self.cfg.rollout.sleep_during_update
        t0 = time.perf_counter()
        if sleep:
            ray.get([e.sleep.remote() for e in self.engines])
        t1 = time.perf_counter()
        stats = ray.get(self.learner.call.remote("train_step", batch))
        t2 = time.perf_counter()
        if sleep:
            ray.get([e.wake_up.remote() for e in self.engines])
            stats[tags.ENGINE_SLEEP] = t1 - t0
            stats[tags.ENGINE_WAKE] = time.perf_counter() - t2
        return stats

    # 6. sync
    def sync_adapter(self) -> int:
        payload = self.learner.call.remote("adapter_payload")  # resolved once in the object store
        versions = ray.get([e.load_adapter.remote(payload) for e in self.engines])
        if len(set(versions)) != 1:
            raise RuntimeError(f"engines serve different adapter versions after sync: {versions}")
        return versions[0]

    # 7. evaluate
    def evaluate(self, prompts: list[PromptItem]) -> float | None:
        if not prompts:
            return None
        from visionrl.eval.local import evaluate_prompts
        from visionrl.eval.report import accuracy
        from visionrl.orchestrate.actors import reward_specs

        if self._eval_reward is None:
            self._eval_reward = build_reward_fn(
                reward_specs(self.cfg), timeout_s=self.cfg.ray.reward_timeout_s
            )
        records = evaluate_prompts(
            _RemoteEngine(self.engines[0]),
            prompts,
            self._eval_reward,
            max_tokens=self.cfg.rollout.max_new_tokens,
        )
        return accuracy(records)

    # 7. checkpoint
    def checkpoint(self, run: Path, step: int, prompts: PromptStream) -> Path:
        from visionrl.checkpoint import save_checkpoint

        payload = ray.get(self.learner.call.remote("adapter_payload", False))  # full precision
        state = ray.get(self.learner.call.remote("state_dict"))
        return save_checkpoint(
            run,
            step,
            adapter_files=payload.files,
            trainer_state=state["trainer_state"],
            sampler_state=prompts.sampler.state_dict(),
            extra={"adapter_version": payload.version},
            keep=self.cfg.logging.keep_checkpoints,
        )

    def resume(self, run: Path, prompts: PromptStream) -> int:
        """Restore learner, sampler and engines from the newest complete checkpoint; returns its step."""
        from visionrl.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(run)
        if path is None:
            logger.warning("no checkpoint in %s: starting from step 0", run / "checkpoints")
            return 0
        ckpt = load_checkpoint(path)
        ray.get(self.learner.call.remote("load_state", str(ckpt.adapter_dir), ckpt.trainer_state))
        prompts.sampler.load_state_dict(ckpt.sampler_state)
        self.sync_adapter()
        logger.info("resumed from %s (step %d)", path, ckpt.step)
        return ckpt.step

    # end of run
    def export_final(self, run: Path, accuracy: float | None) -> Path:
        from visionrl.adapter.manifest import build_manifest, write_manifest
        from visionrl.adapter.storage import filesystem

        adapter_dir = RunDir(run).adapter
        ray.get(self.learner.call.remote("save_adapter", str(adapter_dir)))
        eval_results = {"accuracy": accuracy} if accuracy is not None else None
        manifest = build_manifest(
            adapter_dir,
            base_model=self.cfg.model.path,
            job_config=self.cfg.model_dump(mode="json"),
            eval_results=eval_results,
        )
        # Written last and atomically: a reader that finds the manifest finds a complete adapter.
        write_manifest(*filesystem(adapter_dir), manifest)
        return adapter_dir

    def close(self) -> None:
        ray.get([e.close.remote() for e in self.engines])
        for actor in [self.learner, *self.engines, *self.rewards]:
            ray.kill(actor)


def _reward_record(p: PromptItem) -> dict[str, Any]:
    record = dict(p.record)
    record.setdefault("answer", p.answer)
    return record


def merge_results(parts: list[RewardResult]) -> RewardResult:
    """One RewardResult of several consecutive parts (reward workers, or sampling rounds)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return RewardResult(
        total=[x for p in parts for x in p.total],
        per_reward={k: [x for p in parts for x in p.per_reward[k]] for k in first.per_reward},
        num_errors={k: sum(p.num_errors[k] for p in parts) for k in first.num_errors},
        num_timeouts={k: sum(p.num_timeouts[k] for p in parts) for k in first.num_timeouts},
        error_examples={k: v for p in reversed(parts) for k, v in p.error_examples.items()},
    )


def rollout_samples(
    prompts: list[PromptItem], completions: list[list[Completion]], totals: list[float], n: int
) -> list[RolloutSample]:
    """A few rollouts (the first completion of the first `n` groups) for the TensorBoard picture grid."""
    out = []
    G = len(completions[0]) if completions else 1
    for i, (p, group) in enumerate(zip(prompts[:n], completions[:n], strict=False)):
        if not p.images:
            continue
        question = _question_text(p.record)
        out.append(
            RolloutSample(
                image=p.images[0],
                question=question,
                completion=group[0].text,
                answer=json.dumps(p.answer) if not isinstance(p.answer, str) else p.answer,
                reward=float(totals[i * G]),
            )
        )
    return out


def _question_text(record: dict[str, Any]) -> str:
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    texts = []
    for msg in record.get("messages", []):
        content = msg.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            texts.extend(part.get("text", "") for part in content or [] if part.get("type") == "text")
    return " ".join(t for t in texts if t)
