"""Multi-turn episodes through a served model (`visionrl eval --endpoint URL --env JOB`, also `--sagemaker-endpoint`):
the tool loop runs here, client-side, over the OpenAI chat API.

Each held-out record is one greedy episode: the environment's first observation is the user turn; each turn the
whole conversation so far goes to the endpoint as chat messages (observation images as data URLs, the tools of
the environment in `tools`, `tool_choice: none` so the model's tool call comes back as the text it wrote, which
the environment parses as it does in training); the environment's answer enters as a message of its role
(`tool` for a tool's result). The episode ends as a local one does (done, max_turns, a turn cut at max_tokens,
max_images, an environment failure); the final turn's text is the answer the rewards score. The server applies
the chat template: with the same template, the model sees the tokens a local episode gives it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PIL import Image

from visionrl import metrics as tags
from visionrl.config_env import EnvConfig
from visionrl.data.prompts import question_text
from visionrl.envs.base import Observation
from visionrl.envs.pool import EnvFailure, LocalEnvs
from visionrl.envs.registry import tool_schemas
from visionrl.envs.trajectory import message
from visionrl.openai_wire import Ask, chat_messages
from visionrl.types import Generation, PromptItem

FAILED = ("error", "timeout")


@dataclass
class _Play:
    """One episode's conversation and bookkeeping."""

    key: str
    messages: list[dict[str, Any]]
    images: list[Image.Image]
    turns: int = 0
    env_reward: float = 0.0
    ended: str = ""
    answer: Generation | None = None
    latency_ms: float = 0.0
    tokens: int = 0


class EndpointEpisodes:
    """Greedy episodes of `env` whose turns `ask` answers (`model` at the endpoint)."""

    def __init__(self, env: EnvConfig, ask: Ask, model: str, *, options: dict[str, Any],
                 fit: Callable[[Image.Image], Image.Image], system_prompt: str | None = None) -> None:  # fmt: skip
        self.env, self.ask, self.model, self.fit, self.system_prompt = env, ask, model, fit, system_prompt
        self.options = dict(options)
        tools = tool_schemas(env)
        if tools:
            self.options.update(tools=tools, tool_choice="none")
        self.envs = LocalEnvs(env)
        self._keys = itertools.count()

    def answers(self, prompts: Sequence[PromptItem], concurrency: int, metrics: dict[str, float],
                prompt_key: str = "prompt") -> list[Generation]:  # fmt: skip
        """The final answer of each prompt's episode (a failed episode is a failed answer); the episodes' metrics
        go into `metrics`. The environment gets the record with its question, its images as loaded and answer."""
        records = [
            {**p.record, "prompt": question_text(p.record, prompt_key), "images": p.source_images or p.images,
             "answer": p.answer}
            for p in prompts
        ]  # fmt: skip
        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="eval-episode") as pool:
            plays = list(pool.map(self.play, records))
        metrics.update(self._metrics(plays))
        return [self._answer(p) for p in plays]

    def play(self, record: dict[str, Any]) -> _Play:
        key = f"eval:{next(self._keys)}"
        (obs,) = self.envs.reset([(key, record)])
        try:
            if isinstance(obs, EnvFailure):
                return _Play(key, [], [], ended=obs.kind)
            images = [self.fit(im) for im in obs.images][: self.env.max_images]
            start = [message("system", self.system_prompt)] if self.system_prompt else []
            p = _Play(key, [*start, message(obs.role or "user", obs.text, len(images))], images)
            while not p.ended:
                self._turn(p)
            return p
        finally:
            self.envs.close([key])

    def _turn(self, p: _Play) -> None:
        answer = self.ask(self.model, chat_messages(p.messages, p.images), self.options)
        p.latency_ms += answer.latency_ms
        p.tokens += answer.num_tokens
        p.answer = answer
        if answer.text is None:  # the request failed: no turn to give the environment
            p.ended = "request_failed"
            return
        p.turns += 1
        p.messages.append({"role": "assistant", "content": [{"type": "text", "text": answer.text}]})
        if answer.finish_reason == "length":
            p.ended = "truncated"
            return
        (result,) = self.envs.step([(p.key, answer.text)])
        if isinstance(result, EnvFailure):
            p.env_reward, p.ended = 0.0, result.kind
            return
        p.env_reward += float(result.reward)
        if result.done or result.observation is None:
            p.ended = "done"
        elif p.turns >= self.env.max_turns:
            p.ended = "max_turns"
        else:
            self._observe(p, result.observation)

    def _observe(self, p: _Play, obs: Observation) -> None:
        images = [self.fit(im) for im in obs.images]
        if len(p.images) + len(images) > self.env.max_images:
            p.ended = "max_images"
            return
        p.messages.append(message(obs.role or "tool", obs.text, len(images)))
        p.images.extend(images)

    def _answer(self, p: _Play) -> Generation:
        if p.ended in FAILED or p.answer is None:
            return Generation(None, 0, p.latency_ms, None, f"the environment's episode ended: {p.ended}")
        a = p.answer
        return Generation(a.text, p.tokens, p.latency_ms, a.finish_reason, a.error)

    @staticmethod
    def _metrics(plays: list[_Play]) -> dict[str, float]:
        n = max(len(plays), 1)
        ended = Counter(p.ended for p in plays)
        return {
            tags.EPISODE_TURNS: sum(p.turns for p in plays) / n,
            tags.EPISODE_ENV_REWARD: sum(p.env_reward for p in plays) / n,
            tags.EPISODE_IMAGES: sum(len(p.images) for p in plays) / n,
            **{f"{tags.EPISODE_ENDED_PREFIX}{why}": float(k) for why, k in ended.items()},
        }
