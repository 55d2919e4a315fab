"""The zoom task: four squares, the asked one in its quadrant's crop box, a speck at the budget and a block in its
crop; the zoom environment's crop (and its control, which shows the whole picture); the tiny zoom base's
tokenizer keeps a crop call parseable."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image

from visionrl.data.images import ImageBudget, fit_image
from visionrl.data.synthetic import COLORS
from visionrl.data.zoom import (
    CROP_BOXES,
    QUADRANTS,
    ZOOM_BUDGET,
    ZOOM_SIZE,
    crop_call,
    crop_region,
    make_zoom_dataset,
    render_zoom,
)
from visionrl.envs.tools import parse_tool_calls
from visionrl.envs.zoom import ZoomEnv


def _close(pixel: tuple[int, ...], colour: str, tolerance: int = 30) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(pixel, COLORS[colour], strict=True))


def test_the_asked_square_is_in_its_crop_box_and_every_colour_is_in_the_picture() -> None:
    rng = random.Random(0)
    for where in QUADRANTS:
        picture, meta = render_zoom(rng, "green", where)
        assert picture.size == (ZOOM_SIZE, ZOOM_SIZE) and meta["colors"][where] == "green"
        assert sorted(meta["colors"].values()) == sorted(COLORS)  # all four: the colour alone tells nothing
        for quadrant, colour in meta["colors"].items():
            region = crop_region(picture, *CROP_BOXES[quadrant])
            assert _close(region.getpixel((region.width // 2, region.height // 2)), colour)
            assert not _close(region.getpixel((1, 1)), colour)  # the box's corner is background


def test_at_the_budget_a_square_is_a_speck_and_in_its_crop_a_block() -> None:
    picture, meta = render_zoom(random.Random(1), "red", "top left")
    budget = ImageBudget(1024, ZOOM_BUDGET)
    whole = fit_image(picture, budget, 32)
    assert whole.size == (64, 64)
    reddish = [p for p in whole.getdata() if _close(p, "red", 40)]
    assert len(reddish) <= 4  # 32 px / 16 = 2 px a side, blended at its edges
    crop = fit_image(crop_region(picture, *CROP_BOXES["top left"]), budget, 32)
    assert crop.size == (64, 64)
    assert sum(1 for p in crop.getdata() if _close(p, "red")) >= 28 * 28  # about 32 x 32 px of the 64 x 64


def test_the_dataset_is_balanced_and_its_records_name_their_square(tmp_path: Path) -> None:
    summary = make_zoom_dataset(tmp_path, 16, 8, seed=0)
    assert summary["train"]["answer_counts"] == {c: 4 for c in COLORS}
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    for r in records:
        where = r["metadata"]["where"]
        assert r["prompt"] == f"What color is the square in the {where}?"
        assert r["metadata"]["colors"][where] == r["answer"]
        with Image.open(tmp_path / r["images"][0]) as picture:
            region = crop_region(picture.convert("RGB"), *CROP_BOXES[where])
            assert _close(region.getpixel((region.width // 2, region.height // 2)), r["answer"])
    assert make_zoom_dataset(tmp_path / "again", 16, 8, seed=0) == summary


def test_the_zoom_environment_crops_and_its_control_shows_the_whole_picture() -> None:
    picture, meta = render_zoom(random.Random(2), "blue", "bottom right")
    call = crop_call("bottom right")
    env = ZoomEnv()
    env.reset({"prompt": "What color is the square in the bottom right?", "images": [picture]})
    shown = env.step(call).observation
    assert shown is not None and shown.role == "tool" and shown.images[0].size == (64, 64)
    assert _close(shown.images[0].getpixel((32, 32)), "blue")
    assert env.step("blue").done
    control = ZoomEnv(tool="whole")
    control.reset({"prompt": "", "images": [picture]})
    whole = control.step(call).observation
    assert whole is not None and whole.images[0].size == (ZOOM_SIZE, ZOOM_SIZE)
    with pytest.raises(ValueError, match="tool must be crop or whole"):
        ZoomEnv(tool="zoom")


def test_a_crop_call_survives_the_tiny_zoom_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from visionrl.models.tiny import TOOL_TOKENS, build_tiny_model

    model = build_tiny_model(tmp_path / "model", seed=0, recipe="zoom")
    tok = AutoTokenizer.from_pretrained(model)
    call = crop_call("top right")
    ids = tok(call, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == 31
    assert tok.convert_ids_to_tokens(ids)[0] == TOOL_TOKENS[0]
    text = tok.decode(ids, skip_special_tokens=True)  # as an engine returns the turn's text
    assert parse_tool_calls(text) == [
        ("crop", dict(zip(("x1", "y1", "x2", "y2"), CROP_BOXES["top right"], strict=True)))
    ]
