"""Small typed payloads shared across layers: prompts, sampling settings, completions, generations, adapters.

This module sits at the bottom of the import graph (it imports nothing from visionrl), so the loop, the
engines, the learner, evaluation and serving all depend on it and never on each other for their data. The
payloads cross process boundaries (Ray), so they hold plain data: token ids, floats, strings, PIL images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image


@dataclass
class PromptItem:
    """One prompt of a step: the chat-templated text (image placeholders not yet expanded) and its images.

    A multi-turn episode's prompt also carries `token_ids`: the conversation so far as the engine reads it (one
    `<|image_pad|>` per image, not expanded; engines and the learner expand them), with `images` every image of
    it in order. Engines then read `token_ids` instead of `text` (no re-tokenisation of earlier turns)."""

    text: str
    images: list[Image.Image]
    answer: Any = None
    record: dict[str, Any] = field(default_factory=dict)
    sample_id: str = ""
    token_ids: list[int] | None = None
    # the images as loaded, before the pixel budget: what an environment's `reset` gets (set for multi-turn jobs
    # only, which may crop them: `build_prompt(keep_source=True)`); never sent to an engine
    source_images: list[Image.Image] = field(default_factory=list)


@dataclass
class SamplingSpec:
    """How an engine samples: `n` completions per prompt (the GRPO group)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    greedy: bool = False


@dataclass
class Completion:
    """One sampled completion. `logprobs[i]` is the engine's log-prob of `token_ids[i]` under the sampling
    distribution (temperature applied, forbidden tokens removed), used to report the train/inference mismatch."""

    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" (end of sequence) or "length" (hit max_tokens)
    adapter_version: int = 0
    # A multi-turn episode (visionrl.envs): `token_ids` holds every turn after the prompt, the environment's tokens
    # between them (one <|image_pad|> per observation image); `env_mask[i]` is True where the environment wrote
    # token i (its log-prob is NaN: never trained, never counted); `images` the observations' images in order;
    # `text` the final turn's text (what the job's rewards score); `episode` its turns, returns and how it ended.
    env_mask: list[bool] | None = None
    images: list[Image.Image] = field(default_factory=list)
    episode: dict[str, Any] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Generation:
    """One prompt's answer from any backend (a local engine or a served endpoint), before scoring.

    `text` is None when the request or generation failed, and `error` then says why. `latency_ms` is the
    time this answer took (for batched local generation: the batch's wall time divided by its size).
    """

    text: str | None
    num_tokens: int = 0
    latency_ms: float = 0.0
    finish_reason: str | None = None
    error: str | None = None


# A file's contents: bytes, or a flat uint8 numpy array (the per-step adapter: Ray moves numpy arrays through its
# object store without pickling them and hands them to readers on the same node without a copy).
FileData = Any  # bytes | numpy.ndarray; anything `memoryview` takes

# The files of a PEFT LoRA adapter that visionrl moves around (sync, checkpoints, export, evaluation).
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


@dataclass
class AdapterPayload:
    """A LoRA adapter version as file bytes (adapter_config.json, adapter_model.safetensors), so it can travel
    through Ray's object store to engines on other nodes, which write it to their own local disk."""

    version: int
    files: dict[str, FileData]
    built_s: float = 0.0  # the learner's time to build it (the sync's profile: timing/sync_build_s)
    sent_at: float = 0.0  # wall clock when built: the engine's receipt minus this is timing/sync_transfer_s

    def file_bytes(self, name: str) -> bytes:
        """File `name` as bytes (the engines' copy of the weights is a numpy buffer: `FileData`)."""
        data = self.files[name]
        return data if isinstance(data, bytes) else bytes(memoryview(data))


@dataclass(frozen=True)
class JudgeAsk:
    """What a judge engine answers for each prompt: with `yes_ids` and `no_ids`, the share of the yes tokens among
    the yes and no tokens as its next token (P(yes) / (P(yes) + P(no))); with none, its greedy answer of at most
    `max_tokens` tokens (text)."""

    yes_ids: tuple[int, ...] = ()
    no_ids: tuple[int, ...] = ()
    max_tokens: int = 32

    @property
    def wants_text(self) -> bool:
        return not self.yes_ids


@dataclass
class ProbeResult:
    """What a probe adapter did to an engine's greedy output on the probe prompts (`RolloutEngine.probe`)."""

    tokens_changed: int  # prompts whose first greedy token changed
    largest_change: float  # largest |log-prob change| of a first greedy token that stayed the same (nats)
    # the greedy completions with the probe adapter, for the learner to score
    completions: list[list[Completion]]


class SteppingEngine(Protocol):
    """An engine whose requests run while others join (continuous multi-turn episodes, `visionrl.envs.continuous`):
    prompts submitted at any time join the running batch; finished ones are collected by request id."""

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        """Queue one request per prompt (`spec.n` must be 1) and return their ids at once. A `spec.seed` reseeds
        the engine first, which only a submit with nothing in flight may do (a lane's first turns); later turns
        come with no seed and draw from the running stream."""
        ...

    def collect(self, timeout_s: float) -> dict[str, list[Completion]]:
        """The requests finished since the last call, by id (an empty list: the engine refused that prompt),
        waiting up to `timeout_s` for the first one; at once when nothing is in flight."""
        ...

    def abort(self) -> int:
        """Drop every request in flight and every uncollected result (a failed step); returns how many."""
        ...


class RolloutEngine(SteppingEngine, Protocol):
    """What the loop needs from a rollout engine (vLLM in production, transformers generate as fallback); its
    stepping API plays continuous episodes."""

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        """`spec.n` completions for every prompt, in prompt order; none (an empty list) for a prompt the engine
        rejects (longer than its context, more images than it takes), which the caller skips and counts."""
        ...

    def load_adapter(self, payload: AdapterPayload) -> int:
        """Serve `payload` from now on (a new adapter version); returns the version now served."""
        ...

    def adapter_version(self) -> int:
        """The adapter version this engine serves (0 = base model)."""
        ...

    def probe(self, payload: AdapterPayload, prompts: list[PromptItem]) -> ProbeResult:
        """Greedy completions of `prompts` (at most 4 tokens) with `payload`, and how far they moved from those
        of the version served (no change: the adapter does not reach the model). The served version stays."""
        ...

    def fingerprint(
        self, prompt: PromptItem, max_tokens: int, continuation: list[int] | None = None
    ) -> Completion | None:
        """The greedy completion of `prompt` under the version served (None if the engine rejects it), leaving
        nothing behind that could change later generations (caches). With `continuation`: those tokens after
        `prompt` instead, teacher-forced in one prefill, with their raw log-probs (no token removed)."""
        ...

    def judge(self, prompts: list[PromptItem], ask: JudgeAsk) -> list[float | str | None]:
        """The base model's verdict on each prompt (the adapter switched off; a judge model's own engine has none):
        a yes share or a text as `ask` says, None for a prompt the engine rejects. Leaves the served adapter and
        nothing cached behind."""
        ...

    def rebuilds(self) -> int:
        """How often the engine was rebuilt after an internal error so far (each rebuild is probed again)."""
        ...

    def sleep(self) -> None:
        """Release what the engine can while the learner updates (a no-op where nothing can be released)."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep`; `generate` and `load_adapter` wake a sleeping engine themselves."""
        ...

    def in_flight(self) -> bool:
        """Whether submitted requests are still queued or running (nothing may be left after a step)."""
        ...

    def close(self) -> None: ...
