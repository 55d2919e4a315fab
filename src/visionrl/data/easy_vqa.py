"""The easy-VQA data set (PyPI `easy-vqa`, MIT) in visionrl's own format: a third-party benchmark.

The package ships everything inside its wheel: 4,000 train and 1,000 test PNG images (64x64, one shape of
one colour on a white background) and 38,575 / 9,673 questions about them with 13 answers (yes/no, three
shape names, eight colours). `write_easy_vqa` copies the images next to `train.jsonl` / `eval.jsonl` (the
package's test split) so the data set is self-contained, and tags each record with its question type
(`metadata.question_type`: `yes/no`, `shape` or `color`) for per-type accuracy.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from visionrl.data.synthetic import split_words
from visionrl.errors import InputError

SHAPES = ("circle", "rectangle", "triangle")
YES_NO = ("yes", "no")
QUESTION_TYPES = ("yes/no", "shape", "color")  # what question_type() returns
TASK_NAME = "easy-vqa"
SPLITS = {"train": "train", "eval": "test"}  # our split name -> the package's


def _package() -> Any:
    try:
        import easy_vqa
    except ModuleNotFoundError:
        raise InputError(
            "the easy-vqa task needs the `easy-vqa` package (MIT, images included): pip install easy-vqa"
        ) from None
    return easy_vqa


def question_type(answer: str) -> str:
    """`yes/no`, `shape` or `color`: the kind of answer a question asks for (read from its answer)."""
    return "yes/no" if answer in YES_NO else "shape" if answer in SHAPES else "color"


def answers() -> list[str]:
    """The 13 answers of the data set, in the package's order."""
    return list(_package().get_answers())


def _questions(split: str) -> tuple[list[str], list[str], list[int], dict[int, str]]:
    pkg = _package()
    if split == "train":
        texts, labels, image_ids = pkg.get_train_questions()
        return texts, labels, image_ids, pkg.get_train_image_paths()
    texts, labels, image_ids = pkg.get_test_questions()
    return texts, labels, image_ids, pkg.get_test_image_paths()


def vocabulary() -> list[str]:
    """Every word of every question and answer (both splits), split like the tiny tokenizer splits text."""
    words = {w for a in answers() for w in split_words(a)}
    for split in SPLITS.values():
        words.update(w for q in _questions(split)[0] for w in split_words(q))
    return sorted(words)


def format_examples(rng: random.Random, num: int) -> list[tuple[str, str, str]]:
    """`num` (question, image path, random answer of the question's type) triples of the train split: what a
    tiny base learns so that it answers in format (a colour to a colour question...) but at chance."""
    texts, labels, image_ids, paths = _questions("train")
    by_type: dict[str, list[str]] = {}
    for a in answers():
        by_type.setdefault(question_type(a), []).append(a)
    picks = rng.sample(range(len(texts)), min(num, len(texts)))
    return [(texts[i], paths[image_ids[i]], rng.choice(by_type[question_type(labels[i])])) for i in picks]


def _write_split(out: Path, split: str, num: int | None, seed: int, only_type: str | None) -> dict[str, Any]:
    texts, labels, image_ids, paths = _questions(SPLITS[split])
    order = [i for i in range(len(texts)) if only_type is None or question_type(labels[i]) == only_type]
    if num is not None and num < len(order):
        order = sorted(random.Random(f"{TASK_NAME}/{split}/{seed}").sample(order, num))
    image_dir = out / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    types: Counter[str] = Counter()
    with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for i in order:
            rel = f"images/{split}/{image_ids[i]}.png"
            if not (out / rel).is_file():
                shutil.copyfile(paths[image_ids[i]], out / rel)
            kind = question_type(labels[i])
            record = {
                "id": f"{TASK_NAME}-{split}-{i:05d}",
                "images": [rel],
                "prompt": texts[i],
                "answer": labels[i],
                "metadata": {"task": TASK_NAME, "question_type": kind, "image_id": image_ids[i]},
            }
            f.write(json.dumps(record) + "\n")
            counts[labels[i]] += 1
            types[kind] += 1
    return {
        "file": f"{split}.jsonl",
        "num_samples": len(order),
        "answer_counts": dict(sorted(counts.items())),
        "question_types": dict(sorted(types.items())),
    }


def write_easy_vqa(
    out_dir: str | Path,
    num_train: int | None,
    num_eval: int | None,
    seed: int,
    only_type: str | None = None,
) -> dict[str, Any]:
    """Write `train.jsonl` (the package's train split) and `eval.jsonl` (its test split) with the images they
    use under `images/{train,eval}/`; `only_type` keeps only the questions of that type, and `num_train` /
    `num_eval` then a seeded random subset (None: all).
    Returns {"task", "seed", "answers", "train": split, "eval": split} like `make_dataset`."""
    for name, num in (("num_train", num_train), ("num_eval", num_eval)):
        if num is not None and num < 1:
            raise InputError(f"{name} must be >= 1 (or left out for the whole split), got {num}")
    if only_type is not None and only_type not in QUESTION_TYPES:
        raise InputError(
            f"the question type must be one of {', '.join(QUESTION_TYPES)} (or none for all), got {only_type!r}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"task": TASK_NAME, "seed": seed, "answers": answers()}
    for split, num in (("train", num_train), ("eval", num_eval)):
        summary[split] = _write_split(out, split, num, seed, only_type)
    return summary
