"""Dataset loader (JSONL/Parquet validation, bad-image policies) and the prompt sampler."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.data import DatasetError, PromptSampler, VisionDataset, load_dataset, make_dataset

QUESTION = [{"type": "image"}, {"type": "text", "text": "What color?"}]


def _png(path: Path, color: tuple[int, int, int] = (255, 0, 0), mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), color).convert(mode).save(path)
    return path


def _record(image: str = "img/a.png", **fields: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "images": [image],
        "messages": [{"role": "user", "content": QUESTION}],
        "answer": "red",
    }
    record.update(fields)
    return record


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    """Lines given as dicts are JSON-encoded; strings are written verbatim (blank or broken lines)."""
    text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
    path.write_text(text)
    return path


def _text_dataset(tmp_path: Path, answers: list[str]) -> VisionDataset:
    """Text-only records (images: []) with the given answers, for sampler tests."""
    records = [{"id": f"r{i}", "images": [], "prompt": "q", "answer": a} for i, a in enumerate(answers)]
    return load_dataset(_write_jsonl(tmp_path / "text.jsonl", records))


# --- Loading valid records ---


def test_loads_messages_prompt_and_defaults(tmp_path: Path) -> None:
    _png(tmp_path / "img/a.png", mode="L")
    absolute = str(_png(tmp_path / "elsewhere/b.png", color=(0, 0, 255)))
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            _record(id="first", metadata={"k": 1}, source="web"),
            "   ",  # blank line 2 is skipped but still counted for line numbers
            {"images": [absolute, "img/a.png"], "prompt": "Compare.", "answer": [1, 2]},
            {"images": [], "messages": [{"role": "user", "content": "Just text"}], "answer": 3.5},
        ],
    )
    ds = load_dataset(path)
    assert len(ds) == 3 and ds.num_skipped == 0
    assert ds.ids == ["first", "train-3", "train-4"]
    first = ds[0]
    assert (first.id, first.line, first.answer, first.metadata) == ("first", 1, "red", {"k": 1})
    assert first.record["source"] == "web"  # unknown fields are kept
    assert first.images[0].mode == "RGB" and first.images[0].size == (8, 6)  # grayscale file converted
    assert first.image_paths == [str(tmp_path / "img/a.png")]
    prompt = ds[1]
    assert prompt.messages == [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}],
        }
    ]
    assert prompt.images[0].getpixel((0, 0)) == (0, 0, 255) and prompt.metadata == {}
    assert prompt.answer == [1, 2]
    text_only = ds[2]
    assert text_only.images == [] and text_only.answer == 3.5
    assert text_only.messages == [{"role": "user", "content": [{"type": "text", "text": "Just text"}]}]
    assert ds.records[1] == {"images": [absolute, "img/a.png"], "prompt": "Compare.", "answer": [1, 2]}


def test_max_samples_keeps_the_first_records(tmp_path: Path) -> None:
    _png(tmp_path / "img/a.png")
    # Line 3 is broken, but reading stops after two records.
    path = _write_jsonl(tmp_path / "d.jsonl", [_record(id="x"), _record(id="y"), "{oops"])
    assert load_dataset(path, max_samples=2).ids == ["x", "y"]
    with pytest.raises(ValueError, match="max_samples must be >= 1"):
        load_dataset(path, max_samples=0)


def test_synthetic_output_loads(tmp_path: Path) -> None:
    make_dataset(tmp_path, "color", num_train=5, num_eval=2, seed=0)
    ds = load_dataset(tmp_path / "train.jsonl")
    assert len(ds) == 5 and ds[4].id == "color-train-00004"
    assert ds[4].images[0].size == (64, 64) and ds[4].answer == ds[4].metadata["color"]


# --- Malformed records: the message names file, line and field ---


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        (
            {"images": [], "prompt": "q"},
            "train.jsonl line 2: field 'answer' is missing; every record needs the reference answer",
        ),
        (
            '{"images": [], "answer": 1',
            "train.jsonl line 2: invalid JSON (Expecting ',' delimiter at column 27)",
        ),
        ("[1, 2]", "train.jsonl line 2: expected a JSON object {...}, got list"),
        (
            _record(images=[""]),
            "train.jsonl line 2: field 'images' item 0: an image must be a path, a base64 data URI, bytes",
        ),
        (
            _record(images=[3]),
            "train.jsonl line 2: field 'images' item 0: an image must be a path, a base64 data URI, bytes or a "
            "{bytes, path} struct, got 3",
        ),
        (
            _record(images=[{"bytes": None, "path": None}]),
            "train.jsonl line 2: field 'images' item 0: the image struct has neither 'bytes' nor 'path'",
        ),
        (
            _record(images=["data:image/png,abc"]),
            "train.jsonl line 2: field 'images' item 0: a data URI image must look like 'data:image/png;base64,",
        ),
        (
            _record(images=["data:image/png;base64,!!"]),
            "train.jsonl line 2: field 'images' item 0: the data URI's base64 payload does not decode",
        ),
        ({"prompt": "q", "answer": 1}, "train.jsonl line 2: field 'images' is missing"),
        (
            _record(images=["img/a.png", "img/a.png"]),
            "train.jsonl line 2: field 'messages' has 1 image placeholder(s) "
            '({"type": "image"}) but \'images\' lists 2 image(s)',
        ),
        (_record(prompt="q"), "train.jsonl line 2: has both 'messages' and 'prompt'"),
        ({"images": [], "answer": 1}, "train.jsonl line 2: field 'messages' is missing"),
        (
            _record(messages=[{"role": "user", "content": [{"type": "video"}]}]),
            "train.jsonl line 2: field 'messages[0].content[0]' must be",
        ),
        (
            _record(messages=[{"role": "user", "content": [{"type": "text"}]}]),
            "train.jsonl line 2: field 'messages[0].content[0]' is a text part without a string 'text'",
        ),
        (_record(metadata=[1]), "train.jsonl line 2: field 'metadata' must be an object, got list"),
        (_record(id="ok"), "train.jsonl line 2: field 'id' 'ok' is already used on line 1"),
    ],
)
def test_malformed_record_names_file_line_and_field(tmp_path: Path, bad_line: Any, expected: str) -> None:
    _png(tmp_path / "img/a.png")
    path = _write_jsonl(tmp_path / "train.jsonl", [_record(id="ok"), bad_line])
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="unsupported file type '.csv'; use one of .jsonl"):
        load_dataset(tmp_path / "data.csv")
    with pytest.raises(FileNotFoundError, match="data file not found"):
        load_dataset(tmp_path / "absent.jsonl")
    (tmp_path / "latin.jsonl").write_bytes(b'{"answer": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="latin.jsonl line 1: not valid UTF-8"):
        load_dataset(tmp_path / "latin.jsonl")
    with pytest.raises(ValueError, match="on_bad_image must be 'error' or 'skip'"):
        load_dataset(_write_jsonl(tmp_path / "d.jsonl", [_record()]), on_bad_image="ignore")  # type: ignore[arg-type]


# --- Bad images under both policies ---


def _bad_image_file(tmp_path: Path, kind: str) -> Path:
    _png(tmp_path / "img/a.png")
    if kind == "corrupt":
        (tmp_path / "img/bad.png").write_bytes(b"this is not a png at all")
    if kind == "thin":  # a strip the processor refuses: longer side over 200 x the shorter
        Image.new("RGB", (2010, 10), (255, 0, 0)).save(tmp_path / "img/bad.png")
    lines = [_record(id="good1"), _record(image="img/bad.png", id="bad1"), _record(id="good2")]
    return _write_jsonl(tmp_path / "train.jsonl", [*lines, _record(image="img/bad.png", id="bad2")])


BAD_IMAGES = [
    ("missing", "file not found"),
    ("corrupt", "not a readable image"),
    ("thin", "2010x10 pixels, an aspect ratio over 200 that the Qwen-VL processor refuses"),
]


@pytest.mark.parametrize(("kind", "reason"), BAD_IMAGES)
def test_bad_image_error_policy(tmp_path: Path, kind: str, reason: str) -> None:
    path = _bad_image_file(tmp_path, kind)
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    message = str(info.value)
    assert "train.jsonl line 2: image 'img/bad.png'" in message
    assert reason in message and "data.on_bad_image: skip" in message


@pytest.mark.parametrize(("kind", "reason"), BAD_IMAGES)
def test_bad_image_skip_policy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, reason: str
) -> None:
    path = _bad_image_file(tmp_path, kind)
    with caplog.at_level(logging.WARNING, logger="visionrl.data.dataset"):
        ds = load_dataset(path, on_bad_image="skip")
    assert ds.ids == ["good1", "good2"]
    assert ds.num_skipped == 2 and [line for line, _ in ds.skipped] == [2, 4]
    assert all(reason in why and "img/bad.png" in why for _, why in ds.skipped)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 record(s)" in warnings[0].getMessage()


def test_all_images_bad_is_an_error(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "train.jsonl", [_record(image="nowhere.png")])
    with pytest.raises(DatasetError, match="no usable records \\(1 skipped for bad images\\)"):
        load_dataset(path, on_bad_image="skip")


def test_corrupt_image_without_verify_fails_at_access(tmp_path: Path) -> None:
    path = _bad_image_file(tmp_path, "corrupt")
    ds = load_dataset(path, verify_images=False)  # existence is all that is checked at load
    assert len(ds) == 4 and ds[0].images[0].size == (8, 6)
    with pytest.raises(DatasetError, match="train.jsonl line 2: cannot open image .*bad.png"):
        ds[1]


# --- Parquet ---


def test_parquet_round_trip(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _png(tmp_path / "img/a.png", color=(0, 255, 0))
    records = [
        _record(id="p0", answer="green", metadata={"task": "color"}),
        {"id": "p1", "images": ["img/a.png"], "prompt": "Which?", "answer": "green"},
    ]
    # Parquet has one schema for all rows: a field a record lacks is stored as null.
    columns = sorted({k for r in records for k in r})
    rows = [{k: r.get(k) for k in columns} for r in records]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    ds = load_dataset(tmp_path / "train.parquet")
    assert ds.ids == ["p0", "p1"]
    assert ds[0].messages == [{"role": "user", "content": QUESTION}]
    assert ds[0].metadata == {"task": "color"} and ds[1].metadata == {}  # null column = absent
    assert ds[1].messages[0]["content"][0] == {"type": "image"}
    assert ds[1].images[0].getpixel((3, 3)) == (0, 255, 0)


def test_parquet_error_names_the_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"images": [], "prompt": "q", "answer": "a"}, {"images": [], "prompt": "q", "answer": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match="d.parquet row 2: field 'answer' is missing"):
        load_dataset(tmp_path / "d.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="junk.parquet: cannot read as Parquet"):
        load_dataset(tmp_path / "junk.parquet")


# --- PromptSampler ---


def _take(sampler: PromptSampler, n: int) -> list[list[int]]:
    return [next(sampler) for _ in range(n)]


def test_sampler_epochs_are_permutations(tmp_path: Path) -> None:
    ds = _text_dataset(tmp_path, ["a"] * 6)
    batches = _take(PromptSampler(ds, batch_size=4, seed=0), 3)  # 12 indices = 2 epochs of 6
    flat = [i for b in batches for i in b]
    # Batch 2 spans the boundary: indices 0-5 are epoch 0, 6-11 epoch 1; each epoch a full permutation.
    assert sorted(flat[:6]) == list(range(6)) and sorted(flat[6:]) == list(range(6))
    assert flat[:6] != flat[6:]  # a fresh shuffle per epoch (fixed seed: checked once, stays true)


def test_sampler_is_deterministic_per_seed(tmp_path: Path) -> None:
    ds = _text_dataset(tmp_path, ["a", "b"] * 10)
    assert _take(PromptSampler(ds, 5, seed=1), 6) == _take(PromptSampler(ds, 5, seed=1), 6)
    assert _take(PromptSampler(ds, 5, seed=1), 6) != _take(PromptSampler(ds, 5, seed=2), 6)


def test_batch_larger_than_dataset(tmp_path: Path) -> None:
    ds = _text_dataset(tmp_path, ["a", "b", "c"])
    batch = next(PromptSampler(ds, batch_size=7, seed=0))
    # Two full epochs (each index twice) plus one index from the third epoch.
    assert sorted(Counter(batch).values()) == [2, 2, 3]


def test_balanced_batches_oversample_small_classes(tmp_path: Path) -> None:
    # 12 'a', 4 'b': batch 8 takes 8 // 2 = 4 of each, so every batch holds all four 'b' records once.
    answers = ["a"] * 12 + ["b"] * 4
    ds = _text_dataset(tmp_path, answers)
    sampler = PromptSampler(ds, batch_size=8, seed=3, balance_key="answer")
    seen_a: list[int] = []
    for batch in _take(sampler, 3):
        assert Counter(answers[i] for i in batch) == {"a": 4, "b": 4}
        assert sorted(i for i in batch if answers[i] == "b") == [12, 13, 14, 15]
        seen_a += [i for i in batch if answers[i] == "a"]
    assert sorted(seen_a) == list(range(12))  # 3 batches x 4 = one epoch of class 'a'


def test_balanced_remainder_rotates(tmp_path: Path) -> None:
    # 4 classes, batch 6: 6 // 4 = 1 each plus 2 extra slots; the rotation gives 2 classes 2 in one batch
    # and the other 2 classes 2 in the next, so over two batches every class gets exactly 3.
    answers = [c for c in "abcd" for _ in range(5)]
    sampler = PromptSampler(_text_dataset(tmp_path, answers), 6, seed=0, balance_key="answer")
    first, second = (Counter(answers[i] for i in b) for b in _take(sampler, 2))
    assert sorted(first.values()) == [1, 1, 2, 2] and sorted(second.values()) == [1, 1, 2, 2]
    assert first + second == {"a": 3, "b": 3, "c": 3, "d": 3}


def test_balance_on_nested_key_and_missing_key(tmp_path: Path) -> None:
    records = [{"images": [], "prompt": "q", "answer": 1, "metadata": {"c": i % 2}} for i in range(4)]
    ds = load_dataset(_write_jsonl(tmp_path / "m.jsonl", records))
    batch = next(PromptSampler(ds, 2, seed=0, balance_key="metadata.c"))
    assert sorted(i % 2 for i in batch) == [0, 1]
    with pytest.raises(DatasetError, match="record 'm-1' has no field 'metadata.d'"):
        PromptSampler(ds, 2, seed=0, balance_key="metadata.d")
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptSampler(ds, 0, seed=0)


@pytest.mark.parametrize("balance_key", [None, "answer"])
def test_resume_continues_exactly(tmp_path: Path, balance_key: str | None) -> None:
    ds = _text_dataset(tmp_path, ["a"] * 7 + ["b"] * 3 + ["c"] * 2)
    reference = PromptSampler(ds, 5, seed=9, balance_key=balance_key)
    expected = _take(reference, 10)
    interrupted = PromptSampler(ds, 5, seed=9, balance_key=balance_key)
    _take(interrupted, 4)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as stored in a checkpoint
    assert state["step"] == 4
    resumed = PromptSampler(ds, 5, seed=9, balance_key=balance_key)
    resumed.load_state_dict(state)
    assert _take(resumed, 6) == expected[4:]
    assert resumed.step == 10 and resumed.epochs_seen == pytest.approx(10 * 5 / 12)


def test_unbalanced_state_counts_epoch_and_position(tmp_path: Path) -> None:
    sampler = PromptSampler(_text_dataset(tmp_path, ["a"] * 6), 4, seed=0)
    _take(sampler, 2)  # 8 indices: epoch 0 done, 2 into epoch 1
    state = sampler.state_dict()
    assert (state["epoch"], state["position"]) == ([1], [2])


def test_resume_refuses_changed_settings(tmp_path: Path) -> None:
    ds = _text_dataset(tmp_path, ["a", "b", "b"])
    state = PromptSampler(ds, 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="batch_size was 2, now 3"):
        PromptSampler(ds, 3, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="balance_key was None, now 'answer'"):
        PromptSampler(ds, 2, seed=0, balance_key="answer").load_state_dict(state)
    with pytest.raises(ValueError, match="malformed state"):
        PromptSampler(ds, 2, seed=0).load_state_dict({**state, "position": [3]})
