"""Prompt lengths at load time (image tokens from the header sizes under the budget) against the real
processor's encoding, and the records dropped because they cannot fit the engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from visionrl.data import DatasetError, load_dataset
from visionrl.data.images import ImageBudget
from visionrl.data.lengths import fit_to_engine, prompt_lengths
from visionrl.data.prompts import build_prompt


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and processor (patch 16, merge 2), without weights: enough to encode."""
    from visionrl.models.tiny import save_qwen_processor, train_tokenizer

    out = tmp_path_factory.mktemp("processor")
    train_tokenizer(["what", "color", "is", "the", "shape", "compare"], out)
    save_qwen_processor(out, patch=16, merge=2, min_pixels=32 * 32, max_pixels=448 * 448)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    return out


def _png(path: Path, size: tuple[int, int]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (30, 200, 30)).save(path)
    return path.name


def _data(tmp_path: Path, images_per_record: dict[str, list[tuple[int, int]]]) -> Path:
    lines = []
    for record_id, sizes in images_per_record.items():
        names = [_png(tmp_path / f"{record_id}-{i}.png", size) for i, size in enumerate(sizes)]
        lines.append(
            json.dumps({"id": record_id, "images": names, "prompt": "what color is the shape", "answer": "x"})
        )
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


RECORDS = {
    "photo": [(4000, 3000)],  # 972 image tokens under the default budget (tests/data/test_images.py)
    "two": [(64, 64), (100, 50)],  # 4 + 6 image tokens
    "text": [],
    "tiny": [(10, 10)],  # enlarged to 32 x 32: 1 token
}


def test_lengths_at_load_equal_the_processor_encoding(processor_dir: Path, tmp_path: Path) -> None:
    from visionrl.models.loader import load_processor

    ds = load_dataset(_data(tmp_path, RECORDS))
    budget = ImageBudget()
    processor = load_processor(processor_dir, budget)
    for system in (None, "answer in one word"):
        lengths = prompt_lengths(ds, processor, budget, system)
        encoded = []
        for sample in ds:
            prompt = build_prompt(sample, processor, system)
            enc = processor(text=[prompt.text], images=prompt.images or None, return_tensors="pt")
            encoded.append(int(enc["input_ids"].shape[1]))
        assert lengths == encoded
    # The photo's prompt is the text-only prompt plus <|vision_start|>, its 972 image tokens, <|vision_end|>.
    text_only = lengths[ds.ids.index("text")]
    assert lengths[ds.ids.index("photo")] - text_only == 1 + 972 + 1


def test_records_over_the_limits_are_dropped_counted_and_listed(
    processor_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from visionrl.models.loader import load_processor

    records = {**RECORDS, "three": [(64, 64)] * 3}
    ds = load_dataset(_data(tmp_path, records))
    budget = ImageBudget(max_images=2)
    processor = load_processor(processor_dir, budget)
    lengths = dict(zip(ds.ids, prompt_lengths(ds, processor, budget), strict=True))
    # A context that takes the two-image prompt and the 1-token one but not the photo's 972 image tokens.
    limit = lengths["two"] + 8
    with caplog.at_level(logging.WARNING, logger="visionrl.data.lengths"):
        kept, report = fit_to_engine(ds, processor, budget, max_model_len=limit, max_new_tokens=8)
    assert kept.ids == ["two", "text", "tiny"]
    assert (report.too_many_images, report.too_long, report.num_dropped) == (["three"], ["photo"], 2)
    assert report.longest_kept == lengths["two"]
    assert [why for _, why in kept.skipped] == [
        f"prompt of {lengths['photo']} tokens + rollout.max_new_tokens=8 is over rollout.max_model_len={limit}",
        "3 images, over data.max_images_per_prompt=2",
    ]
    messages = [r.getMessage() for r in caplog.records]
    assert any("dropped 1 record(s) with more than data.max_images_per_prompt=2" in m and m.endswith("ids: three")
               for m in messages)  # fmt: skip
    assert any("dropped 1 record(s) with a prompt" in m and "lower data.max_pixels" in m and m.endswith("ids: photo")
               for m in messages)  # fmt: skip
    # Everything fits a large context: nothing is dropped and the same dataset comes back.
    same, none = fit_to_engine(ds, processor, ImageBudget(max_images=3), max_model_len=4096, max_new_tokens=8)
    assert same is ds and none.num_dropped == 0


def test_no_record_fits_is_an_error(processor_dir: Path, tmp_path: Path) -> None:
    from visionrl.models.loader import load_processor

    ds = load_dataset(_data(tmp_path, {"photo": [(4000, 3000)]}))
    budget = ImageBudget()
    with pytest.raises(DatasetError, match="none of its 1 records fits the engine .*lower data.max_pixels"):
        fit_to_engine(ds, load_processor(processor_dir, budget), budget, max_model_len=512, max_new_tokens=8)
