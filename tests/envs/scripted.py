"""Scripted engines for the episode tests: answers that depend on the turn, so episodes end for known reasons."""

from __future__ import annotations

from visionrl.rollout.stepping import BatchingStepper
from visionrl.types import Completion, PromptItem, SamplingSpec


class ScriptedEngine:
    """Answers "red" in the first turn of every episode and "green" after (ids of the tiny vocabulary), or runs
    out of tokens on prompts whose record says so."""

    def __init__(self, processor) -> None:
        vocab = processor.tokenizer.get_vocab()
        self.words = {w: vocab[w] for w in ("red", "green", "blue", "<|im_end|>")}
        self.pad = vocab["<|image_pad|>"]
        self.calls = 0

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self.calls += 1
        out = []
        for i, p in enumerate(prompts):
            assert p.token_ids is not None and p.token_ids.count(self.pad) == len(p.images)  # images in step
            if p.record.get("long"):
                out.append(
                    [
                        Completion(
                            i,
                            [self.words["blue"]] * spec.max_tokens,
                            "blue blue",
                            [-0.1] * spec.max_tokens,
                            "length",
                        )
                    ]
                )
                continue
            word = "red" if len(p.images) == 1 else "green"
            out.append(
                [Completion(i, [self.words[word], self.words["<|im_end|>"]], word, [-0.1, -0.2], "stop")]
            )
        return out


class RecordingStepper(BatchingStepper):
    """The stepping API over `engine` (a ScriptedEngine), and its turn-by-turn `generate`, logging each turn that
    goes in as ("submit", record name, turn) in `sample_envs.EVENTS`; the `fast` record's second turn opens
    `sample_envs.GATE`."""

    def __init__(self, engine: ScriptedEngine) -> None:
        super().__init__(engine.generate)
        self.engine = engine

    def _log(self, prompts: list[PromptItem]) -> None:
        from tests.envs import sample_envs

        for p in prompts:
            turn = len(p.images)  # one picture per turn (RetryColour shows it again)
            sample_envs.EVENTS.append(("submit", p.record["name"], turn))
            if p.record["name"] == "fast" and turn == 2:
                sample_envs.GATE.set()

    def submit(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[str]:
        self._log(prompts)
        return super().submit(prompts, spec)

    def generate(self, prompts: list[PromptItem], spec: SamplingSpec) -> list[list[Completion]]:
        self._log(prompts)
        return self.engine.generate(prompts, spec)
