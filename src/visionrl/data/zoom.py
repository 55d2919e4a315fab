"""The `zoom` task: a large picture whose detail the model cannot read at the pixel budget without cropping.

Each 1024 x 1024 picture holds four small squares (ZOOM_SQUARE px), one at the centre of each quadrant, in the
four colours in a random order; the question asks the colour of one of them ("What color is the square in the top
left?"). At the demo's budget (data.max_pixels = 64 x 64) the whole picture is 16x smaller and each square is a
2-pixel speck; cropping the quadrant's centre box (`CROP_BOXES`, 1/16 of the picture's side around the square) with
the zoom environment's `crop` tool returns the square 16x larger, as large as the `color` task's shapes. The
answer is that square's colour; all four colours are in every picture, so only the asked square tells it."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from visionrl.data.synthetic import BACKGROUNDS, COLORS, _jitter, _split_rng, balanced_answers

ZOOM_SIZE = 1024  # px: the picture's side
ZOOM_BUDGET = 64 * 64  # the demo's data.max_pixels: the whole picture at 64 x 64, a crop box at 64 x 64
ZOOM_SQUARE = 32  # px: each square's side (2 px at a 64 x 64 budget)
QUADRANTS = ("top left", "top right", "bottom left", "bottom right")
QUESTION = "What color is the square in the {where}?"
CROP_SCALE = 1000  # the crop tool's coordinates: 0..1000 of the width and height (Qwen3-VL's grounding scale)
# each quadrant's crop box: a square of 1/16 of the picture's side around the quadrant's centre (250 or 750)
_HALF = 31
CROP_BOXES: dict[str, tuple[int, int, int, int]] = {
    where: (x - _HALF, y - _HALF, x + _HALF, y + _HALF)
    for where, (x, y) in zip(QUADRANTS, ((250, 250), (750, 250), (250, 750), (750, 750)), strict=True)
}
# The words the tiny zoom base needs beyond the colour task's: its question, and the crop call in Qwen's format
# ({"name": "crop", "arguments": {"x1": 219, ...}}), split as the tiny tokenizer splits (words, punctuation runs).
ZOOM_WORDS = [
    "square", "in", "top", "bottom", "left", "right", "crop", "name", "arguments", "x1", "y1", "x2", "y2",
    '{"', '":', '"', '",', ",", "}}", *sorted({str(v) for box in CROP_BOXES.values() for v in box}),
]  # fmt: skip


def crop_call(where: str) -> str:
    """The tool call that crops the quadrant `where`'s box (Qwen's tool-call format)."""
    x1, y1, x2, y2 = CROP_BOXES[where]
    arguments = {"x1": x1, "y1": y1, "x2": x2, "y2": y2}
    return "<tool_call>" + json.dumps({"name": "crop", "arguments": arguments}) + "</tool_call>"


def render_zoom(rng: random.Random, answer: str, where: str) -> tuple[Image.Image, dict[str, Any]]:
    """A picture whose square in the quadrant `where` has the colour `answer` (the other three: the other colours)."""
    background = rng.choice(sorted(BACKGROUNDS))
    picture = Image.new("RGB", (ZOOM_SIZE, ZOOM_SIZE), BACKGROUNDS[background])
    others = [c for c in sorted(COLORS) if c != answer]
    rng.shuffle(others)
    colours = dict(zip([q for q in QUADRANTS if q != where], others, strict=True))
    colours[where] = answer
    draw = ImageDraw.Draw(picture)
    for quadrant, colour in colours.items():
        x1, y1, x2, y2 = CROP_BOXES[quadrant]
        cx, cy = (x1 + x2) * ZOOM_SIZE // (2 * CROP_SCALE), (y1 + y2) * ZOOM_SIZE // (2 * CROP_SCALE)
        half = ZOOM_SQUARE // 2
        draw.rectangle(
            (cx - half, cy - half, cx + half - 1, cy + half - 1), fill=_jitter(rng, COLORS[colour])
        )
    return picture, {"where": where, "colors": colours, "background": background}


def make_zoom_dataset(out_dir: str | Path, num_train: int, num_eval: int, seed: int) -> dict[str, Any]:
    """`train.jsonl` and `eval.jsonl` of the zoom task (answers balanced, quadrants random) with their pictures."""
    out = Path(out_dir)
    summary: dict[str, Any] = {"task": "zoom", "seed": seed, "image_size": ZOOM_SIZE, "answers": list(COLORS)}
    for split, num in (("train", num_train), ("eval", num_eval)):
        rng, counts = _split_rng(seed, "zoom", split), Counter[str]()
        (out / "images" / split).mkdir(parents=True, exist_ok=True)
        with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for i, answer in enumerate(balanced_answers(rng, tuple(COLORS), num)):
                where = rng.choice(QUADRANTS)
                picture, meta = render_zoom(rng, answer, where)
                rel = f"images/{split}/{i:05d}.png"
                picture.save(out / rel, format="PNG")
                record = {
                    "id": f"zoom-{split}-{i:05d}",
                    "images": [rel],
                    "prompt": QUESTION.format(where=where),
                    "answer": answer,
                    "metadata": {"task": "zoom", **meta},
                }
                f.write(json.dumps(record) + "\n")
                counts[answer] += 1
        summary[split] = {"file": f"{split}.jsonl", "num_samples": num, "answer_counts": dict(counts)}
    return summary


MIN_CROP_SIDE = 4  # pixels: a crop smaller than this is refused (nothing to see)


def crop_region(picture: Image.Image, x1: float, y1: float, x2: float, y2: float) -> Image.Image:
    """The box (x1, y1)-(x2, y2) of `picture`, coordinates 0..CROP_SCALE of its width and height, at the picture's
    own pixels (ValueError for a box outside the picture, inverted, or under MIN_CROP_SIDE pixels)."""
    coords = [float(v) for v in (x1, y1, x2, y2)]
    if not all(0 <= v <= CROP_SCALE for v in coords):
        raise ValueError(f"coordinates run from 0 to {CROP_SCALE}")
    a, b, c, d = coords
    if c <= a or d <= b:
        raise ValueError("x2 must exceed x1 and y2 must exceed y1")
    w, h = picture.size
    box = (
        round(a * w / CROP_SCALE),
        round(b * h / CROP_SCALE),
        round(c * w / CROP_SCALE),
        round(d * h / CROP_SCALE),
    )
    if box[2] - box[0] < MIN_CROP_SIDE or box[3] - box[1] < MIN_CROP_SIDE:
        raise ValueError(f"the box is smaller than {MIN_CROP_SIDE} pixels")
    return picture.crop(box)
