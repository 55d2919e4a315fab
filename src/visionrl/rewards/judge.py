"""A model as the reward: the `judge` entry of a job's `rewards`, its template, and reading the judge's verdict.

A judge is asked, through a template file, whether a completion answers its prompt: it sees the prompt's images,
the question, the reference answer when the record has one, and the completion. Unlike a rule it scores a whole
batch at once (one call per engine), so it is not a per-sample callable of `rewards.registry`: the run's judging
(`orchestrate.judging`) builds the prompts here and sends them to its backend.

Safety against the policy: the completion enters the judge's prompt only between `<completion>` and
`</completion>`, with any such tags of its own removed, so it cannot close the block and speak as the template;
and only the judge's own output is read (its next-token probabilities, or the text it generates), never the
completion's: a completion that writes "<score>1</score>" or "Answer: yes" has not scored itself.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import string
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionrl.types import JudgeAsk

JUDGE = "judge"  # the reward name that selects a judge in the job file
BACKENDS = ("engine", "vllm", "endpoint", "classifier")
SCORES = ("yes_probability", "tag", "scalar")
INPUTS = ("template", "conversation")  # what a classifier reads (the other backends read the template)
SQUASHES = ("sigmoid", "none")
PLACEHOLDERS = ("question", "reference", "completion")
OPEN, CLOSE = "<completion>", "</completion>"
_OWN_TAGS = re.compile(r"<\s*/?\s*completion\s*>", re.I)
_SCORE_TAG = re.compile(r"<score>\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*</score>", re.I)
NO_REFERENCE = "(none)"  # what {reference} reads as when the record has no answer


@dataclass(frozen=True)
class JudgeSpec:
    """The `kwargs` of a `judge` reward (README, Rewards). Paths are relative to the working directory.

    Attributes:
        backend: engine (the rollout engines' base model, the adapter switched off), vllm (a judge model in its
            own Ray actor(s)), endpoint (an OpenAI-compatible server), classifier (a transformers reward model).
        template: the template file; `{completion}` required, `{question}` and `{reference}` optional. Not needed by
            a classifier that reads the conversation.
        score: yes_probability (P(yes) / (P(yes) + P(no)) of the judge's next token), tag (the number inside
            `<score>...</score>` of the judge's greedy answer) or scalar (the classifier's output).
        input: what a classifier reads: template (the rendered template as the user's turn, then the assistant's
            turn opened, as a generative judge is asked) or conversation (the prompt's images and question as the
            user's turn, the completion as the assistant's: how public reward models are trained).
        squash: sigmoid (the classifier's number mapped into (0, 1), like the other rewards) or none (as it is).
        model: the judge checkpoint (vllm, classifier) or the served model's name (endpoint).
        timeout_s: deadline of one judging call (a batch on an engine or actor, one request to an endpoint).
        on_error: the score of a sample whose judging failed or timed out (counted).
    """

    backend: str
    template: str = ""
    score: str = "yes_probability"
    model: str | None = None
    timeout_s: float = 30.0
    on_error: float = 0.0
    yes: tuple[str, ...] = ("yes", "Yes")
    no: tuple[str, ...] = ("no", "No")
    max_tokens: int = 32  # the judge's answer length in `tag` mode
    max_completion_chars: int = 4000  # a longer completion is cut before it enters the judge's prompt
    cache_size: int = 4096  # (prompt, completion) verdicts kept; a repeated pair is not judged again
    max_failed_steps: int = 2  # steps in a row whose every judgement failed before the run stops
    # endpoint
    base_url: str | None = None
    api_key_env: str | None = None  # the environment variable holding the key (none: no key sent)
    max_concurrency: int = 8
    retries: int = 2
    # vllm and classifier: the judge actors
    num_actors: int = 1
    num_gpus: float = 0.0
    num_cpus: float = 0.0
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    # classifier
    input: str = "template"
    squash: str = "sigmoid"
    batch_size: int = 8

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> JudgeSpec:
        """The spec of a job file's `kwargs`; raises ValueError saying which key is wrong and what it takes."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown judge key(s) {unknown}; a judge takes {sorted(known)}")
        values = dict(kwargs)
        for key in ("yes", "no"):
            if key in values:
                words = values[key]
                words = [words] if isinstance(words, str) else words
                if (
                    not isinstance(words, list | tuple)
                    or not words
                    or not all(isinstance(w, str) for w in words)
                ):
                    raise ValueError(f"judge {key}: a word or a list of words, got {values[key]!r}")
                values[key] = tuple(words)
        try:
            spec = cls(**values)
        except TypeError as err:
            raise ValueError(f"judge: {err}") from None
        spec.check()
        return spec

    def check(self) -> None:
        """Raises ValueError for a combination that cannot run (which key, why, what to write)."""
        _one_of("backend", self.backend, BACKENDS)
        _one_of("score", self.score, SCORES)
        _one_of("input", self.input, INPUTS)
        _one_of("squash", self.squash, SQUASHES)
        if self.input == "conversation" and self.backend != "classifier":
            raise ValueError(
                "judge input 'conversation' is read by a classifier (backend classifier); a generative judge is "
                "asked through its template (input: template)"
            )
        if not isinstance(self.template, str) or (not self.template and self.input == "template"):
            raise ValueError(
                "judge template: the path of the template file (e.g. configs/judges/color_match.txt)"
            )
        if (self.score == "scalar") != (self.backend == "classifier"):
            raise ValueError(
                f"judge score {self.score!r} with backend {self.backend!r}: a classifier returns a scalar "
                "(score: scalar); the other backends answer in words (score: yes_probability or tag)"
            )
        if self.backend in ("vllm", "classifier", "endpoint") and not self.model:
            raise ValueError(
                f"judge backend {self.backend!r} needs `model` (the judge checkpoint or served name)"
            )
        if self.backend == "endpoint" and not self.base_url:
            raise ValueError("judge backend 'endpoint' needs `base_url` (e.g. http://127.0.0.1:8000/v1)")
        _positive("timeout_s", self.timeout_s)
        for key in (
            "max_tokens", "max_completion_chars", "cache_size", "max_concurrency", "num_actors", "batch_size",
        ):  # fmt: skip
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ValueError(f"judge {key}: an integer >= 1, got {getattr(self, key)!r}")
        for key in ("retries", "max_failed_steps"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise ValueError(f"judge {key}: an integer >= 0, got {getattr(self, key)!r}")
        if not isinstance(self.on_error, int | float) or not math.isfinite(self.on_error):
            raise ValueError(
                f"judge on_error: a finite number (the score of a failed judgement), got {self.on_error!r}"
            )

    def api_key(self) -> str:
        """The endpoint's key from the environment variable `api_key_env`; raises when that variable is unset."""
        if not self.api_key_env:
            return "EMPTY"
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(
                f"judge api_key_env={self.api_key_env!r} names an environment variable that is not set here; "
                "export it (e.g. in the job's env_vars) or remove api_key_env for an endpoint without a key"
            )
        return key


@dataclass(frozen=True)
class JudgeRequest:
    """One judgement to make: the rendered template and the prompt's images (PIL); the question and the completion
    apart for a classifier that reads the conversation."""

    text: str
    images: tuple[Any, ...] = ()
    question: str = ""
    completion: str = ""


@dataclass(frozen=True)
class JudgeFailure:
    """A judgement that did not come back: it raised or was refused (`timeout` False), or ran out of time."""

    message: str
    timeout: bool = False


def read_verdict(spec: JudgeSpec, raw: float | str | None) -> tuple[float, str] | JudgeFailure:
    """The score and a short verdict for the pictures, from what the judge returned for one request (a yes share,
    its text, a classifier's scalar, or None when the engine refused the prompt)."""
    if raw is None:
        return JudgeFailure(
            "the judge's engine refused this prompt (longer than its max_model_len, or its images)"
        )
    if spec.score == "tag":
        value = tag_score(str(raw))
        if value is None:
            return JudgeFailure(f"the judge wrote no <score>number</score>: {str(raw)[:80]!r}")
        return value, f"score {value:g}"
    if isinstance(raw, str) or not math.isfinite(raw):
        return JudgeFailure(f"the judge returned {raw!r}, not a number")
    if spec.score == "yes_probability":
        return float(raw), f"yes {raw:.2f}"
    return float(raw), f"scalar {raw:.3g}"


def _one_of(key: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"judge {key} {value!r} is not one of {', '.join(choices)}")


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"judge {key}: a positive number, got {value!r}")


def load_template(path: str | Path) -> str:
    """The template's text; raises ValueError when the file is unreadable or names an unknown placeholder."""
    try:
        text = Path(path).read_text(encoding="utf-8").removesuffix("\n")  # a file's last newline is not asked
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(
            f"judge template {str(path)!r} cannot be read ({err.__class__.__name__}: {err}); point `template` at "
            "a UTF-8 text file, relative to the directory the run starts in"
        ) from None
    try:
        fields = [name for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise ValueError(
            f"judge template {str(path)!r}: {err}; write a literal brace as {{{{ or }}}}"
        ) from None
    unknown = sorted({f for f in fields if f not in PLACEHOLDERS})
    if unknown:
        raise ValueError(
            f"judge template {str(path)!r} names unknown placeholder(s) {unknown}; a template may use "
            f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)} (a literal brace is written {{{{ or }}}})"
        )
    if "completion" not in fields:
        raise ValueError(
            f"judge template {str(path)!r} has no {{completion}}: the judge would never see the answer"
        )
    return text


CONVERSATION = "{question}\n{completion}"  # a classifier reading the conversation: its questions' cache key


def judge_template(spec: JudgeSpec) -> str:
    """The entry's template (its file, checked), or for a classifier that reads the conversation and names none,
    the question and the completion (only its cache key is made from it)."""
    return load_template(spec.template) if spec.template else CONVERSATION


def delimited(completion: str, max_chars: int) -> str:
    """The completion as data in the judge's prompt: cut to `max_chars`, its own completion tags removed, between
    OPEN and CLOSE."""
    return f"{OPEN}\n{_OWN_TAGS.sub('', completion[:max_chars]).strip()}\n{CLOSE}"


def render(template: str, question: str, reference: Any, completion: str, max_chars: int = 4000) -> str:
    """The judge's question for one completion (the images go beside it, as the prompt's images did)."""
    ref = (
        NO_REFERENCE
        if reference is None
        else ", ".join(map(str, reference))
        if isinstance(reference, list)
        else str(reference)
    )
    return template.format(question=question, reference=ref, completion=delimited(completion, max_chars))


def tag_score(judge_output: str) -> float | None:
    """The number inside the judge output's first `<score>...</score>`, or None when it wrote none."""
    match = _SCORE_TAG.search(judge_output)
    if match is None:
        return None
    value = float(match.group(1))
    return value if math.isfinite(value) else None


def yes_share(yes_logprobs: Sequence[float], no_logprobs: Sequence[float]) -> float | None:
    """P(yes) / (P(yes) + P(no)) from the log-probs of the yes and no tokens found (None when neither is)."""
    yes = sum(math.exp(x) for x in yes_logprobs if math.isfinite(x))
    no = sum(math.exp(x) for x in no_logprobs if math.isfinite(x))
    return yes / (yes + no) if yes + no > 0 else None


def word_token_ids(tokenizer: Any, words: Sequence[str]) -> tuple[int, ...]:
    """The ids of the words that are one token each (the judge's first answer token); others are left out."""
    ids = []
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if (
            len(encoded) == 1
            and encoded[0] not in ids
            and encoded[0] != getattr(tokenizer, "unk_token_id", None)
        ):
            ids.append(int(encoded[0]))
    return tuple(ids)


def judge_ask(spec: JudgeSpec, tokenizer: Any) -> JudgeAsk:
    """What a judge engine is asked under `spec`: the yes and no words' token ids (yes_probability), or its text."""
    if spec.score != "yes_probability":
        return JudgeAsk(max_tokens=spec.max_tokens)
    yes, no = word_token_ids(tokenizer, spec.yes), word_token_ids(tokenizer, spec.no)
    for key, words, ids in (("yes", spec.yes, yes), ("no", spec.no, no)):
        if not ids:
            raise ValueError(
                f"judge {key} words {list(words)}: none is a single token of the judge model's tokenizer, so its "
                f"next-token probability cannot be read; list the word as the model writes it (e.g. 'Yes') or "
                "use score: tag"
            )
    if set(yes) & set(no):
        raise ValueError(f"judge yes {list(spec.yes)} and no {list(spec.no)} share a token: they must differ")
    return JudgeAsk(yes_ids=yes, no_ids=no)


def pair_key(judge_text: str, image_digest: str) -> str:
    """The cache key of one judgement: the judge's whole question and its images."""
    return hashlib.sha256(f"{image_digest}\0{judge_text}".encode()).hexdigest()


def image_digest(images: Sequence[Any]) -> str:
    """A digest of a prompt's images (PIL images), computed once per prompt, not per completion."""
    h = hashlib.sha256()
    for image in images:
        h.update(f"{image.mode}{image.size}".encode())
        h.update(image.tobytes())
    return h.hexdigest()


class VerdictCache:
    """The last `size` verdicts by `pair_key`: a (prompt, completion) pair judged once is not judged again."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, float] = OrderedDict()
        self.hits = 0

    def get(self, key: str) -> float | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: float) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
