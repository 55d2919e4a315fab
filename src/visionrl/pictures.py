"""Pictures of a few rollouts for TensorBoard: a grid of cells (image, question, completion, answer, reward bar)
and the same samples as a Markdown table. Drawn with PIL's built-in font, so no font files are needed."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSample:
    """One rollout shown in TensorBoard: the prompt image, the question, what the model said, the reference."""

    image: Image.Image
    question: str
    completion: str
    answer: str
    reward: float
    verdict: str = ""  # the judge's verdict on this completion (a `judge` reward), e.g. "yes 0.93"


GRID_PAD = 8  # px between cells and around the grid
TEXT_MARGIN = 4  # px between the picture and the first text line
LINE_HEIGHT = 14  # px per text line; the default font is 13 px tall (ascent 10 + descent 3)
QUESTION_LINES = 3
COMPLETION_LINES = 6
TEXT_LINES = QUESTION_LINES + COMPLETION_LINES + 2  # + the answer line + the reward bar
MAX_COMPLETION_CHARS = 400  # long completions are cut before wrapping; the table shows the same prefix
ELLIPSIS = "..."  # ASCII: the bitmap fallback font has no Unicode ellipsis

_BACKGROUND = (224, 224, 224)
_CELL = (255, 255, 255)
_TEXT = (20, 20, 20)
_COMPLETION_TEXT = (20, 40, 140)
_GOOD = (30, 150, 60)  # reward > 0.5
_BAD = (200, 40, 40)


Font = ImageFont.ImageFont | ImageFont.FreeTypeFont | ImageFont.TransposedFont


def cell_height(cell: int) -> int:
    """Height in px of one grid cell: the cell x cell picture square, then TEXT_LINES lines of text."""
    return cell + TEXT_MARGIN + TEXT_LINES * LINE_HEIGHT


def truncate(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars` characters, ending in ELLIPSIS when something was cut."""
    if len(text) <= max_chars:
        return text
    return text[: max(0, max_chars - len(ELLIPSIS))] + ELLIPSIS


def wrap_text(text: str, width: int, max_lines: int, font: Font | None = None) -> list[str]:
    """Word-wrap `text` to lines at most `width` px wide in `font`; at most `max_lines` lines.

    Words wider than a line are split by character. When the text does not fit, the last line kept
    ends with ELLIPSIS, so a reader sees that something was cut.
    """
    font = font or ImageFont.load_default()
    lines: list[str] = []
    for word in " ".join(text.split()).split(" "):
        candidate = f"{lines[-1]} {word}" if lines and lines[-1] else word
        if lines and font.getlength(candidate) <= width:
            lines[-1] = candidate
            continue
        lines.append("")
        for char in word:  # a new line; split the word when it alone is too wide
            if lines[-1] and font.getlength(lines[-1] + char) > width:
                lines.append("")
            lines[-1] += char
    if len(lines) <= max_lines:
        return lines
    last = lines[max_lines - 1]
    while last and font.getlength(last + ELLIPSIS) > width:
        last = last[:-1]
    return [*lines[: max_lines - 1], last.rstrip() + ELLIPSIS]


def _fit_picture(image: Image.Image, cell: int) -> Image.Image:
    """`image` as RGB, scaled to fit a cell x cell square keeping its aspect ratio."""
    rgb = image.convert("RGB")
    scale = cell / max(rgb.size)
    size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
    # Nearest neighbour keeps small synthetic images crisp when enlarged; shrinking photos needs a filter.
    resample = Image.Resampling.NEAREST if scale >= 1 else Image.Resampling.LANCZOS
    return rgb.resize(size, resample)


def _draw_cell(canvas: Image.Image, sample: RolloutSample, x0: int, y0: int, cell: int, font: Font) -> None:
    """Draw one sample with its top-left corner at (x0, y0)."""
    draw = ImageDraw.Draw(canvas)
    draw.rectangle((x0, y0, x0 + cell - 1, y0 + cell_height(cell) - 1), fill=_CELL)
    picture = _fit_picture(sample.image, cell)
    canvas.paste(picture, (x0 + (cell - picture.width) // 2, y0 + (cell - picture.height) // 2))

    y = y0 + cell + TEXT_MARGIN
    blocks = [
        (wrap_text("Q: " + sample.question, cell, QUESTION_LINES, font), QUESTION_LINES, _TEXT),
        (
            wrap_text(truncate(sample.completion, MAX_COMPLETION_CHARS), cell, COMPLETION_LINES, font),
            COMPLETION_LINES,
            _COMPLETION_TEXT,
        ),
        (wrap_text("answer: " + sample.answer, cell, 1, font), 1, _TEXT),
    ]
    for lines, slots, colour in blocks:
        for i, line in enumerate(lines):
            draw.text((x0 + 1, y + i * LINE_HEIGHT), line, fill=colour, font=font)
        y += slots * LINE_HEIGHT  # fixed slots: every cell has the same layout, the reward bar lines up

    # The reward is a coloured bar, not coloured text, so it reads at a glance in a grid of many cells.
    colour = _GOOD if sample.reward > 0.5 else _BAD
    draw.rectangle((x0, y, x0 + cell - 1, y + LINE_HEIGHT - 1), fill=colour)
    label = f"reward {sample.reward:.2f}" + (f"  judge {sample.verdict}" if sample.verdict else "")
    draw.text((x0 + 2, y), label, fill=(255, 255, 255), font=font)


def render_rollout_grid(samples: Sequence[RolloutSample], cols: int = 4, cell: int = 192) -> Image.Image:
    """One RGB picture of `samples` in a grid of up to `cols` columns, each cell `cell` px wide.

    Size: with c = min(cols, len(samples)) columns and r = ceil(len(samples) / c) rows, the picture is
    c * cell + (c + 1) * GRID_PAD wide and r * cell_height(cell) + (r + 1) * GRID_PAD tall.
    Raises ValueError for no samples or a non-positive `cols` / `cell`; PIL errors of unreadable images
    (OSError, ValueError) propagate.
    """
    if not samples:
        raise ValueError("render_rollout_grid needs at least one sample")
    if cols < 1 or cell < 1:
        raise ValueError(f"cols and cell must be positive, got cols={cols}, cell={cell}")
    ncols = min(cols, len(samples))
    nrows = math.ceil(len(samples) / ncols)
    height = cell_height(cell)
    canvas = Image.new(
        "RGB",
        (ncols * cell + (ncols + 1) * GRID_PAD, nrows * height + (nrows + 1) * GRID_PAD),
        _BACKGROUND,
    )
    font = ImageFont.load_default()
    for i, sample in enumerate(samples):
        row, col = divmod(i, ncols)
        x0 = GRID_PAD + col * (cell + GRID_PAD)
        y0 = GRID_PAD + row * (height + GRID_PAD)
        _draw_cell(canvas, sample, x0, y0, cell, font)
    return canvas


def _markdown_cell(text: str) -> str:
    # A newline ends a Markdown table row and a pipe starts a new column: both must go.
    return " ".join(text.split()).replace("|", "\\|")


def samples_markdown(samples: Sequence[RolloutSample], max_chars: int = MAX_COMPLETION_CHARS) -> str:
    """A Markdown table of `samples` (question, completion cut to `max_chars`, answer, reward, and the judge's
    verdict when a judge scored them)."""
    judged = any(s.verdict for s in samples)
    rows = ["| # | question | completion | answer | reward |" + (" judge |" if judged else "")]
    rows.append("|---|---|---|---|---|" + ("---|" if judged else ""))
    for i, s in enumerate(samples):
        cells = [s.question, truncate(s.completion, max_chars), s.answer]
        row = f"| {i} | " + " | ".join(_markdown_cell(c) for c in cells) + f" | {s.reward:.2f} |"
        rows.append(row + (f" {_markdown_cell(s.verdict)} |" if judged else ""))
    return "\n".join(rows)


STRIP_HEIGHT = 128  # px: the height of each picture in an episode's strip


def strip(pictures: Sequence[Image.Image], height: int = STRIP_HEIGHT, gap: int = 4) -> Image.Image:
    """`pictures` side by side at one height (aspect ratios kept), `gap` pixels apart: an episode's pictures in
    order (the prompt's, then each observation's) as one image for the rollout grid."""
    scaled = [p.convert("RGB").resize((max(1, round(p.width * height / p.height)), height)) for p in pictures]
    out = Image.new("RGB", (sum(p.width for p in scaled) + gap * (len(scaled) - 1), height), _BACKGROUND)
    x = 0
    for p in scaled:
        out.paste(p, (x, 0))
        x += p.width + gap
    return out


def rollout_grid(
    step: int, samples: Sequence[RolloutSample], cols: int = 4, cell: int = 192
) -> Image.Image | None:
    """The grid picture of `samples` (None without samples, or when one cannot be drawn: an unreadable or truncated
    image file is warned about and skipped, as a debugging aid must never stop training)."""
    if not samples:
        return None
    try:
        return render_rollout_grid(samples, cols=cols, cell=cell)
    except (OSError, ValueError) as error:  # what PIL raises for unreadable or unconvertible images
        logger.warning("step %d: rollout picture not written: %s: %s", step, type(error).__name__, error)
        return None
