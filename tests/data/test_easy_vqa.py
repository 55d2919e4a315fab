"""easy-VQA (the `easy-vqa` package) turned into visionrl's format: records, images, question types."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from visionrl.cli import main
from visionrl.data import load_dataset
from visionrl.data.easy_vqa import question_type, vocabulary, write_easy_vqa
from visionrl.errors import InputError

easy_vqa = pytest.importorskip("easy_vqa")


def test_question_types_follow_the_answer() -> None:
    assert [question_type(a) for a in ("yes", "no", "circle", "triangle", "teal", "gray")] == [
        "yes/no", "yes/no", "shape", "shape", "color", "color",
    ]  # fmt: skip


@pytest.mark.slow  # copies the 5,000 images: about 12 s on 2 cores
def test_whole_splits_match_the_package(tmp_path: Path) -> None:
    # The package's README: 38,575 train and 9,673 test questions; 13 answers.
    summary = write_easy_vqa(tmp_path, None, None, seed=0)
    assert summary["train"]["num_samples"] == 38_575 and summary["eval"]["num_samples"] == 9_673
    assert len(summary["answers"]) == 13
    # ... of which 28,407 train and 7,136 test questions are yes/no (the package's README again).
    assert summary["train"]["question_types"]["yes/no"] == 28_407
    assert summary["eval"]["question_types"]["yes/no"] == 7_136
    assert len(list((tmp_path / "images/train").iterdir())) == 4_000
    assert len(list((tmp_path / "images/eval").iterdir())) == 1_000


def test_subset_records_load_and_point_at_the_packaged_image(tmp_path: Path) -> None:
    assert (
        main(["make-data", str(tmp_path), "--task", "easy-vqa", "--num-train", "50", "--num-eval", "20"]) == 0
    )
    lines = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 50 and len((tmp_path / "eval.jsonl").read_text().splitlines()) == 20
    texts, answers, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    for record in lines:
        i = int(record["id"].rsplit("-", 1)[1])  # the question's index in the package's train split
        assert record["prompt"] == texts[i] and record["answer"] == answers[i]
        assert record["metadata"]["question_type"] == question_type(answers[i])
        copied = np.asarray(Image.open(tmp_path / record["images"][0]))
        assert (copied == np.asarray(Image.open(paths[image_ids[i]]))).all()
    ds = load_dataset(tmp_path / "train.jsonl")  # every image decodes in full
    assert len(ds) == 50 and ds[0].images[0].size == (64, 64)
    # The same seed keeps the same subset.
    again = tmp_path / "again"
    write_easy_vqa(again, 50, 20, seed=0)
    assert (again / "train.jsonl").read_text() == (tmp_path / "train.jsonl").read_text()


def test_one_question_type_keeps_only_its_questions(tmp_path: Path) -> None:
    """`--question-type color`: every record a colour question; the whole test split has 1,280 of them (its
    9,673 questions less 7,136 yes/no and 1,257 shape ones, counted by answer)."""
    assert main(["make-data", str(tmp_path), "--task", "easy-vqa", "--question-type", "color",
                 "--num-train", "40"]) == 0  # fmt: skip
    texts, answers, _ = easy_vqa.get_test_questions()
    want = sum(question_type(a) == "color" for a in answers)
    assert want == 1_280
    for split, count in (("train", 40), ("eval", want)):
        lines = [json.loads(x) for x in (tmp_path / f"{split}.jsonl").read_text().splitlines()]
        assert len(lines) == count
        assert {r["metadata"]["question_type"] for r in lines} == {"color"}
        assert {r["answer"] for r in lines} <= {
            "red",
            "green",
            "blue",
            "black",
            "gray",
            "teal",
            "brown",
            "yellow",
        }
    with pytest.raises(InputError, match="the question type must be one of yes/no, shape, color"):
        write_easy_vqa(tmp_path / "x", 5, 5, seed=0, only_type="size")


def test_vocabulary_holds_every_question_word() -> None:
    words = set(vocabulary())
    assert {"teal", "brown", "contain", "present", "not", "there"} <= words
    assert len(words) == 28  # 26 words in the questions, "yes" (only ever an answer), and "?"


def test_format_examples_are_random_answers_of_the_right_type() -> None:
    from visionrl.data.easy_vqa import format_examples

    examples = format_examples(random.Random(0), 400)
    texts, answers, _ = easy_vqa.get_train_questions()
    truth = dict(
        zip(texts, answers, strict=True)
    )  # a question text can repeat; its answer type cannot change
    assert all(question_type(a) == question_type(truth[q]) for q, _, a in examples)
    agree = sum(a == truth[q] for q, _, a in examples if question_type(a) == "yes/no")
    yes_no = sum(question_type(a) == "yes/no" for _, _, a in examples)
    assert 0.35 < agree / yes_no < 0.65  # at chance, not the true labels
