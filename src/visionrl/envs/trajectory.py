"""Token-exact episodes: the tokens of a conversation kept as the engine sampled them, turn after turn.

An `Episode` holds the prompt's tokens and, after them, each generated turn's tokens exactly as sampled (with their
sampling log-probs) and the environment's tokens between turns: the chat template's glue after the model's
end-of-turn token, the observation (its text, one `<|image_pad|>` per image) and the next generation prompt.
Nothing earlier is ever re-rendered: `ChatGlue` renders one observation at a time, after a fixed stand-in
conversation, and keeps only what follows the stand-in's last turn. The image ledger keeps the images in the order
of their placeholders. `replay_mismatch` renders a finished episode with the chat template in one piece and
compares the ids (a template that renders earlier turns differently, or a turn the tokenizer would split
otherwise, shows up there: counted as `episode/replay_mismatches`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from visionrl.envs.base import Observation
from visionrl.types import Completion, PromptItem

# the stand-in conversation an observation is rendered after: its last token is the model's end of turn
_STAND_IN = [
    {"role": "user", "content": [{"type": "text", "text": "x"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "y"}]},
]


def message(role: str, text: str, images: int = 0) -> dict[str, Any]:
    """A chat message: `images` image parts, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    if text:
        parts.append({"type": "text", "text": text})
    return {"role": role, "content": parts}


class ChatGlue:
    """The tokens the chat template puts around turns, for `processor`'s model (and its `tools`, if any)."""

    def __init__(self, processor: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.processor, self.tokenizer, self.tools = processor, processor.tokenizer, tools or None
        from visionrl.models.token_prompts import image_token_id

        self.image_pad = image_token_id(processor)
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn_end = int(end if isinstance(end, int) and end >= 0 else self.tokenizer.eos_token_id)
        stand_in = self.ids(_STAND_IN, generation=False)
        ends = [i for i, t in enumerate(stand_in) if t == self.turn_end]
        if not ends:
            raise ValueError(
                "the chat template ends no assistant turn with <|im_end|> or the end-of-sequence token"
            )
        self._stand_in = stand_in[: ends[-1] + 1]  # up to the assistant's end of turn

    def render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        return str(
            self.processor.apply_chat_template(
                messages, tools=self.tools, add_generation_prompt=generation, tokenize=False
            )
        )

    def ids(self, messages: list[dict[str, Any]], generation: bool) -> list[int]:
        """`messages` rendered and tokenised as the engine reads them (placeholders not expanded)."""
        return list(self.tokenizer(self.render(messages, generation), add_special_tokens=False)["input_ids"])

    def observation_ids(self, obs: Observation) -> list[int]:
        """The tokens after the model's end-of-turn token up to the next generation prompt: the template's glue,
        `obs` as its role's message (one placeholder per image) and the assistant's opening."""
        full = self.ids([*_STAND_IN, message(obs.role, obs.text, len(obs.images))], generation=True)
        n = len(self._stand_in)
        if full[:n] != self._stand_in:
            raise ValueError("the chat template renders an earlier turn differently once another follows it")
        return full[n:]


@dataclass
class Episode:
    """One episode's tokens and images; `group` is its record's index in the step, `member` its index in the group."""

    key: str
    group: int
    member: int
    prompt: PromptItem  # the first user turn, rendered (`token_ids` set)
    messages: list[dict[str, Any]]  # the conversation as messages (for the replay check)
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    env_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[Image.Image] = field(default_factory=list)  # the observations' images
    image_tokens: int = 0  # the expanded tokens of every image of the episode (the prompt's included)
    turns: int = 0
    env_reward: float = 0.0
    ended: str = ""  # why it ended: done, max_turns, truncated, error, timeout, too_long, max_images
    last_text: str = ""
    finish_reason: str = "stop"
    adapter_version: int = 0
    infos: list[dict[str, Any]] = field(default_factory=list)
    prompt_pad: int = -1  # the image placeholder id (set by whoever starts the episode)
    prompt_messages: int = 0  # how many of `messages` are the prompt's (set when the episode starts)

    def __post_init__(self) -> None:
        self.prompt_messages = self.prompt_messages or len(self.messages)

    @property
    def done(self) -> bool:
        return bool(self.ended)

    def end(self, why: str) -> None:
        if not self.ended:
            self.ended = why

    def tokens(self) -> int:
        """The episode's length as the model reads it (placeholders expanded)."""
        assert self.prompt.token_ids is not None
        placeholders = sum(1 for t in self.prompt.token_ids + self.ids if t == self.prompt_pad)
        return len(self.prompt.token_ids) + len(self.ids) - placeholders + self.image_tokens

    def engine_prompt(self) -> PromptItem:
        """What the engine continues: every token so far, every image so far."""
        assert self.prompt.token_ids is not None
        return self._with_every_image([*self.prompt.token_ids, *self.ids])

    def _with_every_image(self, token_ids: list[int] | None) -> PromptItem:
        """The prompt with `token_ids` and every image of the episode (the prompt's, then the observations')."""
        p = self.prompt
        return PromptItem(
            p.text, [*p.images, *self.images], p.answer, p.record, self.key, token_ids=token_ids
        )

    def add_turn(self, turn: Completion, text: str) -> None:
        """The model's turn, its tokens and sampling log-probs exactly as the engine returned them."""
        self.ids += turn.token_ids
        self.env_mask += [False] * len(turn.token_ids)
        self.logprobs += list(turn.logprobs[: len(turn.token_ids)])
        self.logprobs += [float("nan")] * (len(turn.token_ids) - len(turn.logprobs))
        self.turns += 1
        self.last_text, self.finish_reason = text, turn.finish_reason
        self.adapter_version = turn.adapter_version
        self.messages.append(message("assistant", text))

    def add_observation(self, obs: Observation, ids: list[int], image_tokens: int) -> None:
        """The environment's tokens (never trained; NaN log-probs) and the observation's images."""
        self.ids += ids
        self.env_mask += [True] * len(ids)
        self.logprobs += [float("nan")] * len(ids)
        self.images += obs.images
        self.image_tokens += image_tokens
        self.messages.append(message(obs.role, obs.text, len(obs.images)))

    def completion(self) -> Completion:
        """The episode as the loop's completion: its tokens after the prompt, the environment's marked."""
        return Completion(
            prompt_index=self.group,
            token_ids=list(self.ids),
            text=self.last_text,
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason,
            adapter_version=self.adapter_version,
            env_mask=list(self.env_mask),
            images=list(self.images),
            episode={
                "turns": self.turns,
                "env_reward": self.env_reward,
                "ended": self.ended,
                "transcript": self.transcript(),
            },
        )

    def transcript(self) -> str:
        """The turns after the prompt as one line: the model's text, `[tool: ...]` or `[user: ...]` for each
        observation (`<image>` for each of its pictures), and how the episode ended."""
        parts = []
        for m in self.messages[self.prompt_messages :]:
            text = " ".join("<image>" if c["type"] == "image" else c.get("text", "") for c in m["content"])
            parts.append(text if m["role"] == "assistant" else f"[{m['role']}: {text}]")
        return " ".join(parts) + f" ({self.ended})"

    def train_prompt(self) -> PromptItem:
        """The prompt the learner reads this episode with: the prompt's tokens, every image of the episode."""
        return self._with_every_image(self.prompt.token_ids)


def replay_mismatch(glue: ChatGlue, episode: Episode) -> bool:
    """True when rendering the finished conversation in one piece gives other ids than the episode holds (a last
    turn cut by max_tokens is left out of the comparison: the template would close it)."""
    assert episode.prompt.token_ids is not None
    held = [*episode.prompt.token_ids, *episode.ids]
    messages, generation = episode.messages, False
    if episode.finish_reason == "length" and messages and messages[-1]["role"] == "assistant":
        cut = len(held) - _last_turn_length(episode)
        held, messages, generation = held[:cut], messages[:-1], True  # up to the open assistant turn
    rendered = glue.ids(messages, generation=generation)
    return rendered[: len(held)] != held


def _last_turn_length(episode: Episode) -> int:
    n = 0
    for env in reversed(episode.env_mask):
        if env:
            break
        n += 1
    return n
