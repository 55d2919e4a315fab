"""Multi-turn episodes (`env` in the job file): the G episodes of each record of a step, played on the engines.

Two pipelines (`env.pipeline`). `turns`: all live episodes of an engine generate their turn together (each engine
continues its episodes from their token ids: nothing earlier is re-tokenised; with prefix caching the engine does
not re-encode earlier turns), then the environments step all of them at once in the env workers. `continuous`
(`envs.continuous`): an episode's next turn joins the engine's running batch as soon as its environment answers.
An episode ends when its environment says
done, at `env.max_turns`, when a turn is cut by max_new_tokens, when its next turn would not fit
`rollout.max_model_len` or its images `env.max_images`, or when its environment fails (reward 0). Every ending is
counted (`episode/ended_*`), and every finished episode is re-rendered in one piece by the chat template and
compared with its tokens (`episode/replay_mismatches`)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from visionrl import metrics as tags
from visionrl.config import JobConfig
from visionrl.config_env import EnvConfig
from visionrl.data.images import fit_to_processor
from visionrl.data.prompts import question_text
from visionrl.envs.base import Observation, StepResult
from visionrl.envs.pool import EnvFailure
from visionrl.envs.registry import tool_schemas
from visionrl.envs.trajectory import ChatGlue, Episode, message, replay_mismatch
from visionrl.models.token_prompts import encode_images
from visionrl.types import Completion, PromptItem, SamplingSpec

logger = logging.getLogger(__name__)
FAILED = ("error", "timeout")  # endings whose episode scores 0
MAX_ENV_THREADS = 256  # continuous: environment calls in flight at once (each waits on its env worker)


@dataclass
class EpisodeBatch:
    """A step's episodes: per record the first episode's prompt (scoring, pictures), the G episodes as
    completions, each episode's own prompt for the learner, and the step's episode metrics."""

    prompts: list[PromptItem]
    completions: list[list[Completion]]
    train_prompts: list[list[PromptItem]]
    failed: list[list[bool]]
    metrics: dict[str, float]


class EpisodeRunner:
    """Runs episodes of the environment `env` (an EnvConfig) with `processor`'s chat template. `pool` holds the
    environments (`reset`, `step`, `close` by episode key): the env workers, or `LocalEnvs` in this process."""

    def __init__(
        self,
        env: EnvConfig,
        processor: Any,
        pool: Any,
        *,
        max_model_len: int,
        prompt_key: str = "prompt",
        system_prompt: str | None = None,
    ) -> None:
        self.env, self.processor, self.pool = env, processor, pool
        self.max_model_len, self.prompt_key, self.system_prompt = max_model_len, prompt_key, system_prompt
        self.glue = ChatGlue(processor, tool_schemas(env))
        self._lock = threading.Lock()  # the lanes add their environment time to one total
        self._env_s = 0.0

    @classmethod
    def of(cls, cfg: JobConfig, processor: Any, pool: Any) -> EpisodeRunner:
        """The runner of a job's `env` section, with its data layout, system prompt and context length."""
        assert cfg.env is not None
        d = cfg.data
        return cls(cfg.env, processor, pool, max_model_len=cfg.rollout.max_model_len, prompt_key=d.prompt_key,
                   system_prompt=d.system_prompt)  # fmt: skip

    def run(self, records: list[PromptItem], rollout: Any, spec: SamplingSpec) -> EpisodeBatch:
        """The episodes of `records` (G each). `rollout` is one engine or a list of them, one per engine: each
        engine then plays its own records' episodes (a record's G episodes on one engine, sharing its prompt's
        cache) in a lane of its own, so the environments step one engine's episodes while the other engines
        generate theirs; no engine waits for the slowest. An engine is a `generate(prompts, spec)` callable
        (turn by turn) or a `SteppingEngine` (continuous: `envs.continuous`)."""
        episodes = self._start(records, spec.n)
        lanes = rollout if isinstance(rollout, list) else [rollout]
        parts = [[e for e in episodes if e.group % len(lanes) == k] for k in range(len(lanes))]
        self._env_s = 0.0
        continuous = all(hasattr(lane, "submit") for lane in lanes)
        # continuous lanes step each episode's environment on its own: a thread each, shared by the lanes
        env_threads = ThreadPoolExecutor(
            max_workers=min(max(len(episodes), 1), MAX_ENV_THREADS), thread_name_prefix="visionrl-env"
        ) if continuous else None  # fmt: skip
        try:
            if len(lanes) == 1:
                self._play(parts[0], lanes[0], spec, env_threads)
            else:
                with ThreadPoolExecutor(max_workers=len(lanes), thread_name_prefix="visionrl-lane") as pool:
                    for future in [
                        pool.submit(self._play, part, lane, spec, env_threads)
                        for part, lane in zip(parts, lanes, strict=True)
                    ]:
                        future.result()  # an engine's or env worker's failure, raised here
        finally:
            if env_threads is not None:
                env_threads.shutdown(wait=False, cancel_futures=True)
        for e in episodes:
            e.end("max_turns")
        self.pool.close([e.key for e in episodes])
        return self._batch(records, episodes, spec.n, self._env_s)

    def _play(self, part: list[Episode], rollout: Any, spec: SamplingSpec, env_threads: Any) -> None:
        if env_threads is None:
            self._lane(part, rollout, spec)
            return
        from visionrl.envs.continuous import play

        env_s = play(self, part, rollout, replace(spec, n=1), env_threads)
        with self._lock:
            self._env_s += env_s

    def _lane(self, part: list[Episode], rollout: Any, spec: SamplingSpec) -> None:
        """`part`'s episodes to their end: each turn on the engine `rollout`, then their environments' step."""
        for turn in range(self.env.max_turns):
            seed = None if spec.seed is None else spec.seed + 7919 * turn
            acting = self._turn(part, rollout, replace(spec, n=1, seed=seed))
            if not acting:
                return
            self._step(acting)

    def _turn(self, part: list[Episode], rollout: Any, spec: SamplingSpec) -> list[Episode]:
        """One turn of the live episodes of `part` on the engines; returns those whose environment steps next."""
        live = [e for e in part if self.fits(e, spec)]
        if not live:
            return []
        groups = rollout([e.engine_prompt() for e in live], spec)
        return [e for e, group in zip(live, groups, strict=True) if self.take_turn(e, group)]

    def fits(self, e: Episode, spec: SamplingSpec) -> bool:
        """Whether the live episode `e` gets another turn: one that could not fit max_model_len ends it."""
        if not e.done and e.tokens() + spec.max_tokens > self.max_model_len:
            e.end("too_long")
        return not e.done

    def take_turn(self, e: Episode, group: list[Completion]) -> bool:
        """The engine's turn added to `e`; whether its environment steps next (not refused, not cut)."""
        if not group:  # the engine refused the prompt (too long for it, too many images)
            e.end("too_long")
            return False
        e.add_turn(group[0], group[0].text)
        if group[0].finish_reason == "length":
            e.end("truncated")
            return False
        return True

    def _step(self, acting: list[Episode]) -> None:
        """The environments' answers to the episodes' last turns (in the env workers), applied to the episodes."""
        t0 = time.perf_counter()
        results = self.pool.step([(e.key, e.last_text) for e in acting])
        with self._lock:
            self._env_s += time.perf_counter() - t0
        for e, result in zip(acting, results, strict=True):
            self.after_step(e, result)

    def _start(self, records: list[PromptItem], G: int) -> list[Episode]:
        """One episode per record and member, reset in the env workers; a failed reset ends it at once."""
        keys = [
            (f"{i}:{p.sample_id}:{j}:{time.monotonic_ns()}", i, j)
            for i, p in enumerate(records)
            for j in range(G)
        ]
        items = [(key, self._env_record(records[i])) for key, i, _ in keys]
        observations = self.pool.reset(items)
        episodes = []
        for (key, i, j), obs in zip(keys, observations, strict=True):
            if isinstance(obs, EnvFailure):
                episode = self._episode(
                    key, i, j, records[i], Observation(records[i].text, records[i].images)
                )
                episode.end(obs.kind)
                logger.warning("environment reset failed for %s: %s", records[i].sample_id, obs.message)
            else:
                episode = self._episode(key, i, j, records[i], obs)
            episodes.append(episode)
        return episodes

    def _env_record(self, p: PromptItem) -> dict[str, Any]:
        """What `Env.reset` gets: the record as read, with its question's text, its images loaded and its answer."""
        images = p.source_images or p.images  # as loaded (an environment may crop them), else as budgeted
        return {**p.record, "prompt": question_text(p.record, self.prompt_key), "images": images,
                "answer": p.answer}  # fmt: skip

    def _episode(self, key: str, group: int, member: int, record: PromptItem, obs: Observation) -> Episode:
        images = [fit_to_processor(img, self.processor) for img in obs.images][: self.env.max_images]
        messages = []
        if self.system_prompt:
            messages.append(message("system", self.system_prompt))
        messages.append(message("user", obs.text, len(images)))
        text = self.glue.render(messages, generation=True)
        prompt = PromptItem(
            text=text, images=images, answer=record.answer, record=record.record, sample_id=record.sample_id,
            token_ids=self.glue.ids(messages, generation=True),
        )  # fmt: skip
        episode = Episode(key, group, member, prompt, messages, prompt_pad=self.glue.image_pad)
        episode.image_tokens = sum(encode_images(self.processor, images).tokens)
        return episode

    def after_step(self, e: Episode, result: StepResult | EnvFailure) -> None:
        """The environment's answer applied to `e`: it ends the episode or adds the observation's tokens."""
        if isinstance(result, EnvFailure):
            e.env_reward = 0.0
            e.end(result.kind)
            e.infos.append({"failure": result.message})
            return
        e.env_reward += float(result.reward)
        e.infos.append(result.info)
        if result.done or result.observation is None:
            e.end("done")
            return
        if e.turns >= self.env.max_turns:
            e.end("max_turns")
            return
        obs = result.observation
        images = [fit_to_processor(img, self.processor) for img in obs.images]
        if len(e.prompt.images) + len(e.images) + len(images) > self.env.max_images:
            e.end("max_images")
            return
        obs = replace(obs, images=images)
        e.add_observation(
            obs, self.glue.observation_ids(obs), sum(encode_images(self.processor, images).tokens)
        )

    def _batch(
        self, records: list[PromptItem], episodes: list[Episode], G: int, env_s: float
    ) -> EpisodeBatch:
        groups = [episodes[i * G : (i + 1) * G] for i in range(len(records))]
        mismatches = sum(replay_mismatch(self.glue, e) for e in episodes if e.turns)
        ended = Counter(e.ended for e in episodes)
        tokens = sum(len(e.ids) for e in episodes)
        m = {
            tags.EPISODE_TURNS: sum(e.turns for e in episodes) / len(episodes),
            tags.EPISODE_ENV_REWARD: sum(e.env_reward for e in episodes) / len(episodes),
            tags.EPISODE_IMAGES: sum(len(e.prompt.images) + len(e.images) for e in episodes) / len(episodes),
            tags.EPISODE_ENV_TOKENS: sum(sum(e.env_mask) for e in episodes) / max(tokens, 1),
            tags.EPISODE_REPLAY_MISMATCHES: float(mismatches),
            tags.TIMING_ENV: env_s,
            **{f"{tags.EPISODE_ENDED_PREFIX}{why}": float(n) for why, n in ended.items()},
        }
        return EpisodeBatch(
            prompts=[g[0].prompt for g in groups],
            completions=[[e.completion() for e in g] for g in groups],
            train_prompts=[[e.train_prompt() for e in g] for g in groups],
            failed=[[e.ended in FAILED for e in g] for g in groups],
            metrics=m,
        )
