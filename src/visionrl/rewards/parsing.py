"""Text parsing shared by the built-in rewards: answer extraction, normalisation, numbers, boxes.

Everything here is pure string work. Functions that read a *completion* never raise: a malformed
completion simply yields nothing (``None`` / an empty list). Functions that read a *reference answer*
(``parse_reference_number``) raise ``ValueError``, because a bad reference is a dataset bug.
"""

from __future__ import annotations

import math
import re
import unicodedata

# `<answer>` extraction is lenient on case because models drift in tag case early in training; the
# `format` reward is where strictness lives.
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_OPEN = "<answer>"
_THINK_RE = re.compile(r"<think>.*?</think>", re.S | re.I)

_QUOTES = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb"
# `*` too: markdown emphasis ("**blue**") is presentation, not content.
_EDGE_CHARS = _QUOTES + "*"
_TRAILING_PUNCT = ".,;:!?\u3002\uff0c"

# One unsigned number: "1,000" (thousands groups, not followed by more digits), "12", "3.5", ".5", "1e-3".
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+"
# A sign counts only when it does not follow a word character: "3-5" is a range (3 and 5), not 3 and -5.
_NUMBER_RE = re.compile(
    rf"(?<![\w.])(?P<sign>[-+\u2212]?)(?P<num>{_UNSIGNED})(?:\s*/\s*(?P<den>{_UNSIGNED}))?"
)
_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
_NUMBER_WORD_RE = re.compile(r"\b(" + "|".join(_NUMBER_WORDS) + r")\b", re.I)

_COORD = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)"
_SEP = r"(?:\s*,\s*|\s+)"
# "[x1, y1, x2, y2]", "(x1, y1, x2, y2)", "(x1,y1),(x2,y2)", "[[x1,y1],[x2,y2]]", "[x1 y1 x2 y2]".
_BOX_RE = re.compile(
    rf"[\[(]\s*(?P<x1>{_COORD}){_SEP}(?P<y1>{_COORD})\s*[\])]?\s*,?\s*[\[(]?\s*"
    rf"(?P<x2>{_COORD}){_SEP}(?P<y2>{_COORD})\s*[\])]"
)

Box = tuple[float, float, float, float]


def extract_answer(completion: str) -> str:
    """Returns the part of a completion that holds the answer.

    The content of the last ``<answer>...</answer>`` if there is one (the last, because a model that
    restates its answer means the final one); else the text after an unclosed ``<answer>`` (a generation
    cut by the token limit); else the completion with ``<think>...</think>`` blocks removed, so that
    reasoning text does not count as the answer.
    """
    found = _ANSWER_RE.findall(completion)
    if found:
        return found[-1]
    open_at = completion.lower().rfind(_ANSWER_OPEN)
    if open_at >= 0:
        return completion[open_at + len(_ANSWER_OPEN) :]
    return _THINK_RE.sub(" ", completion)


def normalize_text(text: str) -> str:
    """Lowercases, collapses whitespace, strips surrounding quotes/``*`` and trailing punctuation.

    Stripping repeats until nothing changes, so '"Blue."' and "**blue**!" both become "blue".
    """
    text = " ".join(unicodedata.normalize("NFKC", text).lower().split())
    previous = None
    while text != previous:
        previous = text
        text = text.rstrip(_TRAILING_PUNCT).strip(_EDGE_CHARS).strip()
    return text


def _unsigned_value(literal: str) -> float:
    return float(literal.replace(",", ""))


def _match_value(match: re.Match[str]) -> float | None:
    value = _unsigned_value(match["num"])
    if match["den"] is not None:
        denominator = _unsigned_value(match["den"])
        if denominator == 0:
            return None
        value /= denominator
    if match["sign"] in ("-", "\u2212"):
        value = -value
    return value if math.isfinite(value) else None


def last_number(text: str, *, number_words: bool = True) -> float | None:
    """Returns the last number written in ``text``, or ``None``.

    Handles integers, decimals, signs, thousands separators ("1,000"), fractions ("3/4") and
    scientific notation. The last number is used because chain-of-thought text states intermediate
    values first and the result at the end. Number words ("zero" to "twenty") are a fallback used only
    when no digits appear, since words like "one" occur in ordinary prose ("the one on the left").
    """
    values = [v for v in map(_match_value, _NUMBER_RE.finditer(text)) if v is not None]
    if values:
        return values[-1]
    if number_words:
        words = _NUMBER_WORD_RE.findall(text)
        if words:
            return float(_NUMBER_WORDS.index(words[-1].lower()))
    return None


def parse_reference_number(answer: object) -> float:
    """Parses a reference answer (int, float or a string such as "3/4", "-2", "1,000") to a float.

    Raises:
        ValueError: the answer is not exactly one finite number (a dataset error).
    """
    if isinstance(answer, bool):
        raise ValueError(f"reference answer {answer!r} is a bool, expected a number such as 3, 0.75 or '3/4'")
    if isinstance(answer, int | float):
        value = float(answer)
    elif isinstance(answer, str):
        match = _NUMBER_RE.fullmatch(answer.strip().rstrip("."))
        parsed = _match_value(match) if match else None
        if parsed is None:
            raise ValueError(
                f"reference answer {answer!r} is not a number; expected e.g. '3', '-0.5', '3/4' or '1,000'"
            )
        value = parsed
    else:
        raise ValueError(
            f"reference answer {answer!r} has type {type(answer).__name__}; expected a number or a numeric string"
        )
    if not math.isfinite(value):
        raise ValueError(f"reference answer {answer!r} is not finite")
    return value


def find_boxes(text: str) -> list[Box]:
    """Returns every box written as four bracketed numbers in ``text``, in order of appearance."""
    return [(float(m["x1"]), float(m["y1"]), float(m["x2"]), float(m["y2"])) for m in _BOX_RE.finditer(text)]


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two ``(x1, y1, x2, y2)`` boxes.

    A box with ``x2 <= x1`` or ``y2 <= y1`` has zero area, so an inverted prediction scores 0 rather
    than being silently reordered. Returns 0 when the union is empty.
    """
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    intersection = inter_w * inter_h
    area_a = max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
    area_b = max(0.0, b[2] - b[0]) * max(0.0, b[3] - b[1])
    union = area_a + area_b - intersection
    return intersection / union if union > 0 else 0.0
