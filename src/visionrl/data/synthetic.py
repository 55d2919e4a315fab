"""Synthetic visual tasks whose answer can only be read from the image.

They let the demo (a tiny, randomly initialised Qwen3-VL on CPU) and the tests train and evaluate without
downloading anything: every task shows the same question for every sample, so a model that ignores the
image is stuck at chance. `same_color` shows two images per prompt, and only both together give the answer. Images are small PIL drawings without anti-aliasing, so that a simple pixel rule
recovers the answer (the tests use this to prove the answer really is in the image).

`make_dataset` writes the user-facing data format (JSONL + PNG files with relative paths), so the demo goes
through exactly the loader a real job uses.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from visionrl.errors import InputError

RGB = tuple[int, int, int]

# Colour names are the answers of the `color` task; the other tasks draw their shapes in these too.
COLORS: dict[str, RGB] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 205, 40),
}
# Every shape colour differs from both backgrounds by far more than the jitter in at least one channel,
# so "pixel != background" separates shape from background exactly.
BACKGROUNDS: dict[str, RGB] = {"white": (255, 255, 255), "gray": (215, 215, 215)}
COLOR_JITTER = 20
MIN_IMAGE_SIZE = 32
MAX_IMAGE_SIZE = 1024
SPLITS = ("train", "eval")

# One token per word or punctuation mark: the rule the tiny demo tokenizer should also use.
WORD_PATTERN = re.compile(r"[a-z0-9]+|[^\sa-z0-9]")


@dataclass(frozen=True)
class TaskItem:
    """One rendered sample: the picture (and, for multi-image tasks, the further pictures of the same
    prompt, in order), its answer and what was drawn (JSON-serialisable)."""

    image: Image.Image
    answer: str
    metadata: dict[str, Any]
    more_images: tuple[Image.Image, ...] = ()

    @property
    def images(self) -> list[Image.Image]:
        return [self.image, *self.more_images]


@dataclass(frozen=True)
class Task:
    """A synthetic task: one fixed question, a closed set of answers, and a renderer.

    `render(rng, answer, image_size)` draws a picture whose correct answer is `answer`; the caller picks the
    answers so that they are balanced.
    """

    name: str
    question: str
    answers: tuple[str, ...]
    render: Callable[[random.Random, str, int], TaskItem]


def split_words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks of `text`, in order (see WORD_PATTERN)."""
    return WORD_PATTERN.findall(text.lower())


def _jitter(rng: random.Random, color: RGB) -> RGB:
    r, g, b = (min(255, max(0, c + rng.randint(-COLOR_JITTER, COLOR_JITTER))) for c in color)
    return (r, g, b)


def _new_canvas(rng: random.Random, size: int) -> tuple[Image.Image, str]:
    background = rng.choice(sorted(BACKGROUNDS))
    return Image.new("RGB", (size, size), BACKGROUNDS[background]), background


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill: RGB, rng: random.Random
) -> None:
    """Fill `shape` inside the inclusive pixel box (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    if shape in ("rectangle", "square"):
        draw.rectangle(box, fill=fill)
    elif shape in ("ellipse", "circle"):
        draw.ellipse(box, fill=fill)
    elif shape == "triangle":
        # Base along the bottom edge, apex anywhere on the top edge: stays inside the box.
        draw.polygon([(x0, y1), (x1, y1), (rng.randint(x0, x1), y0)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _random_color(rng: random.Random) -> tuple[str, RGB]:
    name = rng.choice(sorted(COLORS))
    return name, _jitter(rng, COLORS[name])


def _render_color(rng: random.Random, answer: str, size: int) -> TaskItem:
    image, background = _new_canvas(rng, size)
    shape = rng.choice(("rectangle", "ellipse", "triangle"))
    lo, hi = math.ceil(0.4 * size), int(0.8 * size)
    width, height = rng.randint(lo, hi), rng.randint(lo, hi)
    x0, y0 = rng.randint(0, size - width), rng.randint(0, size - height)
    box = (x0, y0, x0 + width - 1, y0 + height - 1)
    fill = _jitter(rng, COLORS[answer])
    _draw_shape(ImageDraw.Draw(image), shape, box, fill, rng)
    meta = {"shape": shape, "color": answer, "rgb": list(fill), "background": background, "box": list(box)}
    return TaskItem(image, answer, meta)


def _place_apart(rng: random.Random, sides: list[int], size: int, gap: int) -> list[tuple[int, int]]:
    """Top-left corners for squares of the given sides, at least `gap` pixels apart and inside the image.

    The gap keeps shapes from touching, so they stay separate 4-connected blobs (countable by flood fill).
    """
    while True:  # restart from scratch when crowded; at these sizes a restart is rare
        corners: list[tuple[int, int]] = []
        for side in sides:
            for _ in range(200):
                x, y = rng.randint(0, size - side), rng.randint(0, size - side)
                if all(
                    x >= cx + cs + gap or cx >= x + side + gap or y >= cy + cs + gap or cy >= y + side + gap
                    for (cx, cy), cs in zip(corners, sides, strict=False)
                ):
                    corners.append((x, y))
                    break
            else:
                break
        if len(corners) == len(sides):
            return corners


def _render_count(rng: random.Random, answer: str, size: int) -> TaskItem:
    image, background = _new_canvas(rng, size)
    draw = ImageDraw.Draw(image)
    lo = max(4, round(0.12 * size))
    sides = [rng.randint(lo, max(lo, round(0.18 * size))) for _ in range(int(answer))]
    shapes = []
    for (x, y), side in zip(_place_apart(rng, sides, size, gap=2), sides, strict=True):
        shape = rng.choice(("circle", "square"))
        color, fill = _random_color(rng)
        box = (x, y, x + side - 1, y + side - 1)
        _draw_shape(draw, shape, box, fill, rng)
        shapes.append({"shape": shape, "color": color, "box": list(box)})
    return TaskItem(image, answer, {"count": int(answer), "background": background, "shapes": shapes})


def _render_position(rng: random.Random, answer: str, size: int) -> TaskItem:
    image, background = _new_canvas(rng, size)
    # Thirds of the image: [0, b1), [b1, b2), [b2, size). The shape's box lies wholly inside the outer
    # band named by the answer and wholly inside the middle band of the other axis: never ambiguous.
    b1, b2 = size // 3, size - size // 3
    side = rng.randint(round(0.15 * size), round(0.25 * size))
    outer = {"left": (0, b1), "top": (0, b1), "right": (b2, size), "bottom": (b2, size)}[answer]
    along = rng.randint(outer[0], outer[1] - side)
    across = rng.randint(b1, b2 - side)
    x0, y0 = (along, across) if answer in ("left", "right") else (across, along)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    shape = rng.choice(("rectangle", "ellipse", "triangle"))
    color, fill = _random_color(rng)
    _draw_shape(ImageDraw.Draw(image), shape, box, fill, rng)
    meta = {"shape": shape, "color": color, "position": answer, "background": background, "box": list(box)}
    return TaskItem(image, answer, meta)


def _render_sides(rng: random.Random, answer: str, size: int) -> TaskItem:
    image, background = _new_canvas(rng, size)
    radius = rng.uniform(0.3 * size, 0.45 * size)
    # Keep the circumscribed circle (and so every vertex) inside the image.
    cx, cy = rng.uniform(radius, size - 1 - radius), rng.uniform(radius, size - 1 - radius)
    rotation = rng.uniform(0.0, 360.0)
    color, fill = _random_color(rng)
    ImageDraw.Draw(image).regular_polygon((cx, cy, radius), int(answer), rotation=rotation, fill=fill)
    meta = {
        "sides": int(answer),
        "color": color,
        "background": background,
        "center": [round(cx, 3), round(cy, 3)],
        "radius": round(radius, 3),
        "rotation": round(rotation, 3),
    }
    return TaskItem(image, answer, meta)


def _render_same_color(rng: random.Random, answer: str, size: int) -> TaskItem:
    """Two pictures of one shape each (as in `color`); "yes" when both shapes have the same colour. Either
    picture alone says nothing about the answer: only comparing both does."""
    first = rng.choice(sorted(COLORS))
    second = first if answer == "yes" else rng.choice(sorted(set(COLORS) - {first}))
    a, b = _render_color(rng, first, size), _render_color(rng, second, size)
    meta = {"colors": [first, second], "shapes": [a.metadata["shape"], b.metadata["shape"]]}
    return TaskItem(a.image, answer, meta, more_images=(b.image,))


TASKS: dict[str, Task] = {
    "color": Task("color", "What color is the shape?", tuple(COLORS), _render_color),
    "count": Task("count", "How many shapes are in the image?", ("1", "2", "3", "4"), _render_count),
    "position": Task(
        "position",
        "Where is the shape? Answer left, right, top or bottom.",
        ("left", "right", "top", "bottom"),
        _render_position,
    ),
    "sides": Task("sides", "How many sides does the shape have?", ("3", "4", "5", "6"), _render_sides),
    # Two images per prompt. Worded with words the other questions and the tiny tokenizer's base words
    # already hold, so adding this task leaves the demo's tokenizer (and so its base model) unchanged.
    "same_color": Task("same_color", "Are the two shapes one color?", ("yes", "no"), _render_same_color),
}


def list_tasks() -> list[str]:
    """Names of the synthetic tasks, in registry order."""
    return list(TASKS)


def task_vocabulary() -> list[str]:
    """Every token (lower-cased word or punctuation mark, split by WORD_PATTERN) of any question or answer.

    The tiny demo tokenizer includes these so that each answer is a single token.
    """
    words: set[str] = set()
    for task in TASKS.values():
        words.update(split_words(task.question))
        for answer in task.answers:
            words.update(split_words(answer))
    return sorted(words)


def _split_rng(seed: int, task: str, split: str) -> random.Random:
    # A hash of (task, split, seed) gives train and eval independent streams: the eval set does not change
    # when num_train changes, and no sample is a shifted copy of another split's.
    digest = hashlib.sha256(f"visionrl.synthetic/{task}/{split}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def balanced_answers(rng: random.Random, answers: tuple[str, ...], num: int) -> list[str]:
    """`num` answers in random order where each class occurs num // k or num // k + 1 times."""
    order = list(answers)
    rng.shuffle(order)  # which classes get the +1 is random, not always the first ones
    labels = [order[i % len(order)] for i in range(num)]
    rng.shuffle(labels)
    return labels


def _write_split(out: Path, task: Task, split: str, num: int, seed: int, image_size: int) -> dict[str, Any]:
    rng = _split_rng(seed, task.name, split)
    image_dir = out / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for i, answer in enumerate(balanced_answers(rng, task.answers, num)):
            item = task.render(rng, answer, image_size)
            rels = [f"images/{split}/{i:05d}{'' if k == 0 else f'_{k}'}.png" for k in range(len(item.images))]
            for rel, image in zip(rels, item.images, strict=True):
                image.save(out / rel, format="PNG")
            content = [{"type": "image"} for _ in rels] + [{"type": "text", "text": task.question}]
            record = {
                "id": f"{task.name}-{split}-{i:05d}",
                "images": rels,
                "messages": [{"role": "user", "content": content}],
                "answer": item.answer,
                "metadata": {"task": task.name, **item.metadata},
            }
            f.write(json.dumps(record) + "\n")
            counts[answer] += 1
    return {
        "file": f"{split}.jsonl",
        "num_samples": num,
        "answer_counts": {a: counts[a] for a in task.answers},
    }


def make_dataset(
    out_dir: str | Path, task: str, num_train: int, num_eval: int, seed: int, image_size: int = 64
) -> dict[str, Any]:
    """Render a synthetic task into `out_dir` and return a summary.

    Writes `train.jsonl`, `eval.jsonl` and `images/{train,eval}/NNNNN.png` (paths in the records are
    relative to the JSONL files). The same arguments always give the same bytes. Existing files of the same
    names are overwritten; other files in `out_dir` are left alone.

    Returns {"task", "seed", "image_size", "question", "answers", "train": split, "eval": split}, each split
    being {"file", "num_samples", "answer_counts": {answer: count}}.
    """
    if task not in TASKS:
        raise InputError(f"unknown synthetic task {task!r}; choose one of: {', '.join([*TASKS, 'zoom'])}")
    for name, num in (("num_train", num_train), ("num_eval", num_eval)):
        if num < 0:
            raise InputError(f"{name} must be >= 0, got {num}")
    if not MIN_IMAGE_SIZE <= image_size <= MAX_IMAGE_SIZE:
        raise InputError(
            f"image_size must be in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}] pixels, got {image_size}; "
            "smaller images cannot show the shapes unambiguously"
        )
    spec = TASKS[task]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "task": task,
        "seed": seed,
        "image_size": image_size,
        "question": spec.question,
        "answers": list(spec.answers),
    }
    for split, num in zip(SPLITS, (num_train, num_eval), strict=True):
        summary[split] = _write_split(out, spec, split, num, seed, image_size)
    return summary
