"""Built-in reward functions: exact match, multiple choice, numeric, format and box IoU.

Every reward has the signature ``f(completion, answer, record, **kwargs) -> float`` and returns a
value in [0, 1]. A malformed *completion* scores 0.0 and never raises (the policy produces garbage
early in training, and that is exactly what the reward must score). A malformed *reference answer*
raises ``ValueError`` naming it, because it is a dataset bug that no policy can fix.

``BUILTIN_REWARDS`` maps the registered names to the functions; ``BUILTIN_KWARG_CHECKS`` validates
keyword arguments from the job file when the reward is built, so a bad tolerance fails at startup
instead of turning every score into a counted error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from visionrl.rewards.parsing import (
    Box,
    box_iou,
    extract_answer,
    find_boxes,
    last_number,
    normalize_text,
    parse_reference_number,
)

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# A whole (normalised, so lowercase) answer that is just a letter: "b", "(b)", "b.", "b)".
_BARE_LETTER_RE = re.compile(r"\(?([a-z])\)?[.:)]?")
# A leading label: "B. blue", "(B) blue", "B) blue", "B: blue". Uppercase only, so the article in
# "A red square" is not read as option A.
_LEADING_LABEL_RE = re.compile(r"\s*(?:\(([A-Z])\)|([A-Z])[).:])(?=\s|$)")
_KEYWORD_LETTER_RE = re.compile(r"(?i:answer|option|choice)(?:\s+is)?\s*[:=]?\s*\(?([A-Z])\)?(?![A-Za-z])")
_PAREN_LETTER_RE = re.compile(r"\(([A-Z])\)")
_FORMAT_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.S)
_TAG_RE = re.compile(r"</?(?:think|answer)>", re.I)


def _reference_texts(answer: object) -> list[str]:
    """Normalised reference strings; a list answer means several acceptable answers."""
    items = list(answer) if isinstance(answer, list | tuple) else [answer]
    texts: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ValueError(f"reference answer {answer!r} must be a string, a number or a list of them")
        text = normalize_text(str(item))
        if not text:
            raise ValueError(f"reference answer {answer!r} is empty after normalisation")
        texts.append(text)
    if not texts:
        raise ValueError("reference answer is an empty list")
    return texts


def exact_match(
    completion: str, answer: Any, record: Mapping[str, Any], *, first_word: bool = False
) -> float:
    """1.0 if the normalised answer text equals a normalised reference, else 0.0.

    The answer text is the ``<answer>`` content when present (see ``extract_answer``). With
    ``first_word=True`` only the leading words are compared: as many as the reference has (one for
    "blue", two for "light blue"), so "blue, clearly" matches "blue". ``answer`` may be a list of
    acceptable references.
    """
    references = _reference_texts(answer)
    predicted = normalize_text(extract_answer(completion))
    for reference in references:
        candidate = predicted
        if first_word:
            num_words = len(reference.split())
            candidate = normalize_text(" ".join(predicted.split()[:num_words]))
        if candidate == reference:
            return 1.0
    return 0.0


def _choices_of(record: Mapping[str, Any]) -> list[str] | None:
    metadata = record.get("metadata")
    choices = metadata.get("choices") if isinstance(metadata, Mapping) else None
    if choices is None:
        choices = record.get("choices")
    if choices is None:
        return None
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"record 'choices' must be a list of option texts, got {choices!r}")
    if not 1 <= len(choices) <= len(_LETTERS):
        raise ValueError(f"record 'choices' must hold 1 to {len(_LETTERS)} options, got {len(choices)}")
    return list(choices)


def _reference_choice(answer: Any, choices: list[str] | None) -> tuple[str | None, str | None]:
    """Resolves the reference to (correct letter, correct option text); either may be unknown (None)."""
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"reference answer {answer!r} must be an option letter or an option text")
    reference = normalize_text(str(answer))
    if not reference:
        raise ValueError(f"reference answer {answer!r} is empty")
    normalised_choices = [normalize_text(c) for c in choices] if choices else []
    bare = _BARE_LETTER_RE.fullmatch(reference)
    if bare:
        index = _LETTERS.index(bare.group(1).upper())
        if choices is None:
            return _LETTERS[index], None
        if index < len(choices):
            return _LETTERS[index], choices[index]
    if choices is None:
        return None, str(answer)
    if reference in normalised_choices:
        index = normalised_choices.index(reference)
        return _LETTERS[index], choices[index]
    raise ValueError(
        f"reference answer {answer!r} is neither an option letter nor one of the choices {choices}"
    )


def _predicted_letter(text: str) -> str | None:
    """The option letter a completion commits to, or None. Rules in order of precedence:
    the whole answer is a letter; a leading label ("B. ..."); the last "answer is X" / "option: X";
    exactly one distinct parenthesised letter "(X)" anywhere (several means hedging: no letter)."""
    bare = _BARE_LETTER_RE.fullmatch(normalize_text(text))
    if bare:
        return bare.group(1).upper()
    label = _LEADING_LABEL_RE.match(text)
    if label:
        return label.group(1) or label.group(2)
    keyword = _KEYWORD_LETTER_RE.findall(text)
    if keyword:
        return keyword[-1]
    parenthesised = set(_PAREN_LETTER_RE.findall(text))
    return parenthesised.pop() if len(parenthesised) == 1 else None


def _mentions(text: str, phrase: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


def choice(completion: str, answer: Any, record: Mapping[str, Any]) -> float:
    """Multiple-choice reward: 1.0 if the completion picks the correct option by letter or by text.

    The reference ``answer`` is a letter ("B", "(b)") or an option text. Options come from
    ``record["metadata"]["choices"]`` or ``record["choices"]`` (letters A, B, ... by position). A
    completion may answer "B", "(B)", "B.", "Answer: B", "B. blue" or the option text. Without a letter,
    text counts if it equals the correct option, or if it mentions the correct option and no other one
    (naming two options is hedging and scores 0).
    """
    choices = _choices_of(record)
    correct_letter, correct_text = _reference_choice(answer, choices)
    text = extract_answer(completion)
    letter = _predicted_letter(text)
    if letter is not None:
        return 1.0 if letter == correct_letter else 0.0
    if correct_text is None:
        return 0.0
    predicted = normalize_text(text)
    if predicted == normalize_text(correct_text):
        return 1.0
    if not choices or not predicted:
        return 0.0
    mentioned = {normalize_text(c) for c in choices if _mentions(predicted, normalize_text(c))}
    return 1.0 if mentioned == {normalize_text(correct_text)} else 0.0


def numeric(
    completion: str,
    answer: Any,
    record: Mapping[str, Any],
    *,
    abs_tol: float = 1e-6,
    rel_tol: float = 0.0,
    number_words: bool = True,
) -> float:
    """1.0 if the last number in the answer text is within tolerance of the reference, else 0.0.

    The answer text is the ``<answer>`` content when present. The last number is used (see
    ``last_number``): "3 + 4 = 7" answers 7. Tolerance follows ``math.isclose``: equal when
    ``|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol)``. The reference may be a number or a numeric
    string ("3/4", "0.75", "1,000").
    """
    reference = parse_reference_number(answer)
    predicted = last_number(extract_answer(completion), number_words=number_words)
    if predicted is None:
        return 0.0
    return 1.0 if math.isclose(predicted, reference, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def format_reward(completion: str, answer: Any, record: Mapping[str, Any]) -> float:
    """1.0 if the completion is exactly ``<think>...</think>`` then ``<answer>...</answer>``, else 0.0.

    Whitespace around and between the blocks is allowed; the answer must be non-empty; tags are
    lowercase and appear once each (a nested or repeated tag fails). ``answer`` is unused.
    """
    match = _FORMAT_RE.fullmatch(completion)
    if match is None:
        return 0.0
    thought, final = match.group(1), match.group(2)
    if _TAG_RE.search(thought) or _TAG_RE.search(final) or not final.strip():
        return 0.0
    return 1.0


def _reference_boxes(answer: Any) -> list[Box]:
    """Parses one box [x1, y1, x2, y2], a list of boxes, or a string holding boxes."""
    if isinstance(answer, str):
        raw: list[Any] = [list(box) for box in find_boxes(answer)]
    elif isinstance(answer, list | tuple) and answer and isinstance(answer[0], list | tuple):
        raw = list(answer)
    else:
        raw = [answer]
    if not raw:
        raise ValueError(
            f"reference answer {answer!r} holds no box; expected [x1, y1, x2, y2] or a list of them"
        )
    boxes: list[Box] = []
    for box in raw:
        ok = isinstance(box, list | tuple) and len(box) == 4
        ok = ok and all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in box
        )
        if not ok or not (box[2] > box[0] and box[3] > box[1]):
            raise ValueError(
                f"reference box {box!r} in answer {answer!r} is malformed; expected [x1, y1, x2, y2] "
                "with x2 > x1 and y2 > y1"
            )
        boxes.append((float(box[0]), float(box[1]), float(box[2]), float(box[3])))
    return boxes


def iou(completion: str, answer: Any, record: Mapping[str, Any], *, threshold: float | None = None) -> float:
    """IoU of the first predicted box with the best-matching reference box.

    The prediction is the first box in the answer text written as four bracketed numbers
    ("[10, 20, 30, 40]", "(10,20),(30,40)"). With ``threshold`` set the reward is binary:
    1.0 if the IoU is at least ``threshold``, else 0.0. Coordinates are compared as given, so the
    prompt and the reference must use the same coordinate system.
    """
    references = _reference_boxes(answer)
    predicted = find_boxes(extract_answer(completion))
    if not predicted:
        return 0.0
    best = max(box_iou(predicted[0], reference) for reference in references)
    if threshold is None:
        return best
    return 1.0 if best >= threshold else 0.0


def _check_exact_match(kwargs: Mapping[str, Any]) -> None:
    if not isinstance(kwargs.get("first_word", False), bool):
        raise ValueError(f"first_word must be true or false, got {kwargs['first_word']!r}")


def _check_numeric(kwargs: Mapping[str, Any]) -> None:
    for key in ("abs_tol", "rel_tol"):
        value = kwargs.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value < math.inf):
            raise ValueError(f"{key} must be a finite number >= 0, got {value!r}")
    if not isinstance(kwargs.get("number_words", True), bool):
        raise ValueError(f"number_words must be true or false, got {kwargs['number_words']!r}")


def _check_iou(kwargs: Mapping[str, Any]) -> None:
    threshold = kwargs.get("threshold")
    if threshold is None:
        return
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1] or null, got {threshold!r}")


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "choice": choice,
    "numeric": numeric,
    "format": format_reward,
    "iou": iou,
}

# Value checks run when a reward is built; unknown keyword names are caught by signature binding.
BUILTIN_KWARG_CHECKS: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "exact_match": _check_exact_match,
    "numeric": _check_numeric,
    "iou": _check_iou,
}


def list_builtin_rewards() -> list[str]:
    """Names of the built-in rewards, sorted."""
    return sorted(BUILTIN_REWARDS)


__all__ = [
    "BUILTIN_KWARG_CHECKS",
    "BUILTIN_REWARDS",
    "choice",
    "exact_match",
    "format_reward",
    "iou",
    "list_builtin_rewards",
    "numeric",
]
