"""Synthetic tasks: file layout, determinism, answer balance, and that the answer is readable from pixels."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from visionrl.data.synthetic import (
    BACKGROUNDS,
    COLORS,
    TASKS,
    balanced_answers,
    list_tasks,
    make_dataset,
    split_words,
    task_vocabulary,
)


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pixels(root: Path, record: dict[str, Any]) -> np.ndarray:
    return np.asarray(Image.open(root / record["images"][0]).convert("RGB")).astype(int)


def _shape_mask(pixels: np.ndarray) -> np.ndarray:
    """True where a pixel is not one of the two background colours (drawing has no anti-aliasing)."""
    mask = np.ones(pixels.shape[:2], dtype=bool)
    for rgb in BACKGROUNDS.values():
        mask &= ~(pixels == rgb).all(axis=-1)
    return mask


def _count_components(mask: np.ndarray) -> int:
    """Number of 4-connected True regions, by an explicit flood fill."""
    seen = np.zeros_like(mask)
    height, width = mask.shape
    count = 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        count += 1
        stack = [(y0, x0)]
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < height and 0 <= nx < width and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_list_tasks_and_registry() -> None:
    assert list_tasks() == ["color", "count", "position", "sides", "same_color"]
    assert TASKS["sides"].answers == ("3", "4", "5", "6")


def test_layout_and_record_format(tmp_path: Path) -> None:
    summary = make_dataset(tmp_path, "color", num_train=6, num_eval=3, seed=0)
    train = _records(tmp_path / "train.jsonl")
    assert len(train) == 6 and len(_records(tmp_path / "eval.jsonl")) == 3
    first = train[0]
    assert first["id"] == "color-train-00000"
    assert first["images"] == ["images/train/00000.png"]
    assert first["messages"] == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}
    ]
    assert first["answer"] in COLORS
    assert first["metadata"]["task"] == "color" and first["metadata"]["color"] == first["answer"]
    assert sorted(p.name for p in (tmp_path / "images" / "eval").iterdir()) == [
        "00000.png",
        "00001.png",
        "00002.png",
    ]
    with Image.open(tmp_path / "images/train/00005.png") as image:
        assert image.size == (64, 64) and image.mode == "RGB"
    assert summary["train"]["num_samples"] == 6 and summary["eval"]["file"] == "eval.jsonl"
    assert summary["question"] == "What color is the shape?"


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        make_dataset(tmp_path / name, "count", num_train=8, num_eval=4, seed=seed)
    a, b, c = (_files(tmp_path / n) for n in "abc")
    assert a == b
    assert a.keys() == c.keys()
    assert a["train.jsonl"] != c["train.jsonl"]
    assert all(a[k] != c[k] for k in a if k.endswith(".png"))


def test_eval_stream_is_independent_of_train(tmp_path: Path) -> None:
    make_dataset(tmp_path / "small", "position", num_train=2, num_eval=5, seed=1)
    make_dataset(tmp_path / "large", "position", num_train=9, num_eval=5, seed=1)
    small, large = _files(tmp_path / "small"), _files(tmp_path / "large")
    eval_files = [k for k in small if k.startswith("eval") or k.startswith("images/eval")]
    assert len(eval_files) == 6
    assert all(small[k] == large[k] for k in eval_files)
    # Disjoint streams: the first train and eval images are different pictures.
    assert small["images/train/00000.png"] != small["images/eval/00000.png"]


@pytest.mark.parametrize("task", ["color", "count", "position", "sides"])
def test_answers_are_balanced(tmp_path: Path, task: str) -> None:
    # 10 samples over 4 classes: each class 10 // 4 = 2 or 3 times, and the summary matches the file.
    summary = make_dataset(tmp_path, task, num_train=10, num_eval=4, seed=7)
    counts = Counter(r["answer"] for r in _records(tmp_path / "train.jsonl"))
    assert set(counts) == set(TASKS[task].answers)
    assert sorted(counts.values()) == [2, 2, 3, 3]
    assert summary["train"]["answer_counts"] == dict(counts)
    assert summary["eval"]["answer_counts"] == dict.fromkeys(TASKS[task].answers, 1)


def test_balanced_answers_edge_cases() -> None:
    import random

    assert balanced_answers(random.Random(0), ("a", "b"), 0) == []
    three = balanced_answers(random.Random(0), ("a", "b", "c", "d"), 3)
    assert len(set(three)) == 3  # fewer samples than classes: no class repeats


def test_color_is_the_mean_shape_colour(tmp_path: Path) -> None:
    make_dataset(tmp_path, "color", num_train=40, num_eval=0, seed=11)
    for record in _records(tmp_path / "train.jsonl"):
        pixels = _pixels(tmp_path, record)
        mask = _shape_mask(pixels)
        # The shape is at least 40% of the side in both directions: well over 10% of the area for a triangle.
        assert mask.sum() >= 0.4 * 0.4 * 64 * 64 / 2 - 64
        mean = pixels[mask].mean(axis=0)
        nearest = min(COLORS, key=lambda name: float(((mean - np.array(COLORS[name])) ** 2).sum()))
        assert nearest == record["answer"], record["id"]


def _colour_name(root: Path, rel: str) -> str:
    """The colour whose RGB is nearest the mean of the shape's pixels."""
    pixels = np.asarray(Image.open(root / rel).convert("RGB")).astype(int)
    mean = pixels[_shape_mask(pixels)].mean(axis=0)
    return min(COLORS, key=lambda name: float(((mean - np.array(COLORS[name])) ** 2).sum()))


def test_same_color_needs_both_images(tmp_path: Path) -> None:
    summary = make_dataset(tmp_path, "same_color", num_train=40, num_eval=2, seed=13)
    records = _records(tmp_path / "train.jsonl")
    assert summary["train"]["answer_counts"] == {"yes": 20, "no": 20}  # balanced: chance is 0.5
    assert records[3]["images"] == ["images/train/00003.png", "images/train/00003_1.png"]
    assert records[3]["messages"][0]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "Are the two shapes one color?"},
    ]
    firsts = Counter()
    for record in records:
        first, second = (_colour_name(tmp_path, rel) for rel in record["images"])
        assert record["answer"] == ("yes" if first == second else "no"), record["id"]
        assert record["metadata"]["colors"] == [first, second]
        firsts[(first, record["answer"])] += 1
    # One image alone does not give the answer: each colour of the first image comes with both answers.
    assert {a for (_, a) in firsts} == {"yes", "no"}
    assert sum(1 for c in COLORS if firsts[(c, "yes")] and firsts[(c, "no")]) >= 3


def test_count_is_the_number_of_blobs(tmp_path: Path) -> None:
    make_dataset(tmp_path, "count", num_train=40, num_eval=0, seed=12)
    for record in _records(tmp_path / "train.jsonl"):
        assert _count_components(_shape_mask(_pixels(tmp_path, record))) == int(record["answer"]), record[
            "id"
        ]


@pytest.mark.parametrize("size", [32, 64])
def test_position_is_the_band_of_the_centroid(tmp_path: Path, size: int) -> None:
    make_dataset(tmp_path, "position", num_train=40, num_eval=0, seed=13, image_size=size)
    third = size / 3
    for record in _records(tmp_path / "train.jsonl"):
        ys, xs = np.nonzero(_shape_mask(_pixels(tmp_path, record)))
        cx, cy = xs.mean(), ys.mean()
        band_x = "left" if cx < third else "right" if cx >= size - third else "middle"
        band_y = "top" if cy < third else "bottom" if cy >= size - third else "middle"
        expected = {"left": ("left", "middle"), "right": ("right", "middle")}
        expected |= {"top": ("middle", "top"), "bottom": ("middle", "bottom")}
        assert (band_x, band_y) == expected[record["answer"]], record["id"]


def test_sides_from_the_filled_fraction_of_the_circumcircle(tmp_path: Path) -> None:
    # A regular n-gon of circumradius R covers n/(2 pi) sin(2 pi/n) of the circle's area:
    # n=3: 0.413, n=4: 0.637, n=5: 0.757, n=6: 0.827. R is estimated as the largest distance of a shape
    # pixel from the centroid (+0.5 px); at 128 px the rasterisation error is small enough to separate 5 and 6.
    fractions = {n: n / (2 * math.pi) * math.sin(2 * math.pi / n) for n in range(3, 7)}
    make_dataset(tmp_path, "sides", num_train=40, num_eval=0, seed=14, image_size=128)
    for record in _records(tmp_path / "train.jsonl"):
        ys, xs = np.nonzero(_shape_mask(_pixels(tmp_path, record)))
        radius = np.sqrt((ys - ys.mean()) ** 2 + (xs - xs.mean()) ** 2).max() + 0.5
        filled = len(xs) / (math.pi * radius**2)
        nearest = min(fractions, key=lambda n: abs(fractions[n] - filled))
        assert str(nearest) == record["answer"], record["id"]


def test_vocabulary_covers_every_question_and_answer(tmp_path: Path) -> None:
    vocab = set(task_vocabulary())
    assert {"what", "color", "?", "red", "yellow", "4", "6", "bottom", ",", "."} <= vocab
    assert split_words("Where is it? Answer left, right.") == [
        "where", "is", "it", "?", "answer", "left", ",", "right", ".",
    ]  # fmt: skip
    for task in list_tasks():
        make_dataset(tmp_path / task, task, num_train=4, num_eval=0, seed=0)
        for record in _records(tmp_path / task / "train.jsonl"):
            text = record["messages"][0]["content"][-1]["text"]
            assert set(split_words(text)) | set(split_words(record["answer"])) <= vocab


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="unknown synthetic task 'shade'.*color, count, position, sides, same"
    ):
        make_dataset(tmp_path, "shade", 1, 1, seed=0)
    with pytest.raises(ValueError, match="num_eval must be >= 0, got -1"):
        make_dataset(tmp_path, "color", 1, -1, seed=0)
    with pytest.raises(ValueError, match="image_size must be in \\[32, 1024\\]"):
        make_dataset(tmp_path, "color", 1, 1, seed=0, image_size=16)


def test_zero_samples_writes_empty_split(tmp_path: Path) -> None:
    summary = make_dataset(tmp_path, "sides", num_train=0, num_eval=2, seed=0)
    assert (tmp_path / "train.jsonl").read_text() == ""
    assert summary["train"]["answer_counts"] == {"3": 0, "4": 0, "5": 0, "6": 0}
