"""The layouts users bring (Geometry3K/EasyR1 parquet, Hugging Face image columns, JSONL with data URIs), the
full decode of every image at load, and records whose images fail mid-run (skipped, counted, resumable)."""

from __future__ import annotations

import base64
import io
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from visionrl.data import DatasetError, PromptSampler, load_dataset
from visionrl.data.layouts import Layout
from visionrl.data.sampler import draw_samples

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _encoded(color: tuple[int, int, int], fmt: str = "PNG", size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def _noise(fmt: str) -> bytes:
    """A 64x64 noise image: its JPEG has enough entropy-coded data that cutting the tail leaves the markers
    PIL's verify() reads intact, while the pixels can no longer be decoded."""
    rng = random.Random(0)
    image = Image.frombytes("RGB", (64, 64), bytes(rng.randrange(256) for _ in range(64 * 64 * 3)))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _odd_tiff() -> bytes:
    """A TIFF whose header claims 7 samples per pixel: PIL cannot decode that pixel layout."""
    data = bytearray(_encoded((1, 2, 3), "TIFF"))
    offset = int.from_bytes(data[4:8], "little")
    for i in range(int.from_bytes(data[offset : offset + 2], "little")):
        entry = offset + 2 + 12 * i
        if int.from_bytes(data[entry : entry + 2], "little") == 277:  # SamplesPerPixel
            data[entry + 8 : entry + 10] = (7).to_bytes(2, "little")
    return bytes(data)


def _data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


# --- The layouts users bring ---


def test_geometry3k_style_parquet_with_structs_and_markers(tmp_path: Path) -> None:
    # Geometry3K / EasyR1: `images` holds {bytes, path} structs, `problem` marks where each image goes.
    rows = [
        {
            "images": [{"bytes": _encoded(RED), "path": "r.png"}, {"bytes": _encoded(GREEN), "path": None}],
            "problem": "<image>Compare the first with <image> the second.",
            "answer": "12",
        },
        {"images": [{"bytes": _encoded(BLUE), "path": "b.png"}], "problem": "Find x. <image>", "answer": "3"},
    ]
    path = _parquet(tmp_path / "geo.parquet", rows)
    with pytest.raises(DatasetError, match="field 'messages' is missing.*set data.prompt_key"):
        load_dataset(path)  # our own field names: the question column is not found
    ds = load_dataset(path, layout=Layout(prompt_key="problem"))
    first, second = ds[0], ds[1]
    assert first.messages == [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Compare the first with"},
                {"type": "image"},
                {"type": "text", "text": "the second."},
            ],
        }
    ]
    assert [im.getpixel((0, 0)) for im in first.images] == [RED, GREEN]
    assert second.messages[0]["content"] == [{"type": "text", "text": "Find x."}, {"type": "image"}]
    assert second.images[0].getpixel((7, 5)) == BLUE and second.answer == "3"
    # The kept record (rewards, prompts across processes) names the images instead of carrying their bytes.
    sizes = len(_encoded(RED)), len(_encoded(GREEN))
    assert first.record["images"] == [f"<image 0: {sizes[0]} bytes, r.png>", f"<image 1: {sizes[1]} bytes>"]
    assert first.image_paths == first.record["images"] and ds.ids == ["geo-1", "geo-2"]


def test_raw_bytes_and_hugging_face_single_image_column(tmp_path: Path) -> None:
    raw = _parquet(
        tmp_path / "raw.parquet", [{"images": [_encoded(GREEN)], "prompt": "Colour?", "answer": "g"}]
    )
    assert load_dataset(raw)[0].images[0].getpixel((1, 1)) == GREEN
    hf_rows = [
        {"image": {"bytes": _encoded(RED, "JPEG"), "path": None}, "question": "What colour?", "label": "red"},
        {"image": {"bytes": None, "path": "img/b.png"}, "question": "And this one?", "label": "blue"},
    ]
    (tmp_path / "img").mkdir()
    (tmp_path / "img/b.png").write_bytes(_encoded(BLUE))
    layout = Layout(prompt_key="question", answer_key="label", image_key="image")
    ds = load_dataset(_parquet(tmp_path / "hf.parquet", hf_rows), layout=layout)
    assert [s.answer for s in ds] == ["red", "blue"]
    # JPEG is lossy: a flat red decodes to within a few levels of (255, 0, 0).
    r, g, b = ds[0].images[0].getpixel((4, 3))
    assert r > 240 and g < 15 and b < 15
    assert ds[1].images[0].getpixel((0, 0)) == BLUE
    assert ds[1].image_paths == [str(tmp_path / "img/b.png")]  # a struct with only a path reads the file
    assert ds[0].messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "What colour?"}]


def test_jsonl_with_paths_and_data_uris(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(_encoded(RED))
    records = [
        {"images": ["a.png", _data_uri(_encoded(GREEN))], "prompt": "<image> vs <image>?", "answer": "no"},
        {"images": _data_uri(_encoded(BLUE)), "prompt": "One image, no list.", "answer": "blue"},
    ]
    ds = load_dataset(_jsonl(tmp_path / "uri.jsonl", records))
    assert [im.getpixel((0, 0)) for im in ds[0].images] == [RED, GREEN]
    assert ds[0].record["images"] == [
        "a.png",
        f"<image 1: {len(_encoded(GREEN))} bytes>",
    ]  # the path kept as written
    assert ds[1].images[0].getpixel((0, 0)) == BLUE


@pytest.mark.parametrize(
    ("prompt", "images", "expected"),
    [
        (
            "<image><image> two markers",
            1,
            "field 'prompt' has 2 <image> marker(s) but the record has 1 image(s)",
        ),
        ("<image> one marker", 2, "field 'prompt' has 1 <image> marker(s) but the record has 2 image(s)"),
    ],
)
def test_marker_count_must_match_images(tmp_path: Path, prompt: str, images: int, expected: str) -> None:
    uri = _data_uri(_encoded(RED))
    path = _jsonl(tmp_path / "m.jsonl", [{"images": [uri] * images, "prompt": prompt, "answer": "a"}])
    with pytest.raises(DatasetError, match=re.escape(expected)):
        load_dataset(path)


def test_mapped_keys_name_themselves_in_errors(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "k.jsonl", [{"pics": [], "q": "text only", "answer": "a"}])
    with pytest.raises(DatasetError, match="k.jsonl line 1: field 'images' is missing.*set data.image_key"):
        load_dataset(path)
    with pytest.raises(DatasetError, match="field 'label' is missing.*set data.answer_key"):
        load_dataset(path, layout=Layout(prompt_key="q", image_key="pics", answer_key="label"))
    ds = load_dataset(path, layout=Layout(prompt_key="q", image_key="pics"))
    assert ds[0].images == [] and ds[0].messages[0]["content"] == [{"type": "text", "text": "text only"}]
    bad = _parquet(tmp_path / "s.parquet", [{"images": [{"bytes": b"x", "path": "p", "mode": "RGB"}]}])
    with pytest.raises(
        DatasetError, match="s.parquet row 1: field 'images' item 0: an image struct has only"
    ):
        load_dataset(bad)


# --- Bad images: a full decode at load ---

TRUNCATED_JPEG = _noise("JPEG")[:-100]
BAD_IMAGES = {
    # name: (file bytes, what the reason says)
    "truncated_png": (_noise("PNG")[:-100], "image file is truncated"),
    "truncated_jpeg": (TRUNCATED_JPEG, "image file is truncated"),
    "zero_bytes": (b"", "empty (0 bytes)"),
    "not_an_image": (b"GIF89a? no, just text", "cannot identify image file"),
    "unsupported_layout": (_odd_tiff(), "cannot identify image file"),
}


def test_truncated_jpeg_passes_a_header_check() -> None:
    # Why the load decodes every pixel: PIL's verify() accepts this file (the failure mode).
    with Image.open(io.BytesIO(TRUNCATED_JPEG)) as image:
        image.verify()
    with (
        pytest.raises(OSError, match="image file is truncated"),
        Image.open(io.BytesIO(TRUNCATED_JPEG)) as image,
    ):
        image.convert("RGB")


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_bad_image_files_fail_at_load(tmp_path: Path, name: str) -> None:
    data, reason = BAD_IMAGES[name]
    (tmp_path / "good.png").write_bytes(_encoded(RED))
    (tmp_path / "bad.img").write_bytes(data)
    records = [
        {"id": "g", "images": ["good.png"], "prompt": "q", "answer": "a"},
        {"id": "b", "images": ["bad.img"], "prompt": "q", "answer": "a"},
    ]
    path = _jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(DatasetError) as info:
        load_dataset(path)
    assert "d.jsonl line 2: image 'bad.img'" in str(info.value) and reason in str(info.value)
    assert "data.on_bad_image: skip" in str(info.value)
    ds = load_dataset(path, on_bad_image="skip")
    assert ds.ids == ["g"] and ds.num_skipped == 1 and reason in ds.skipped[0][1]


@pytest.mark.parametrize("name", ["truncated_jpeg", "zero_bytes", "not_an_image"])
def test_bad_image_bytes_in_parquet_are_skipped_and_counted(tmp_path: Path, name: str) -> None:
    data, reason = BAD_IMAGES[name]
    rows = [
        {"images": [{"bytes": b, "path": None}], "prompt": "q", "answer": "a"} for b in (_encoded(RED), data)
    ]
    path = _parquet(tmp_path / "b.parquet", rows)
    where = f"b.parquet row 2: image '<image 0: {len(data)} bytes>': "
    with pytest.raises(DatasetError, match=re.escape(where) + ".*" + re.escape(reason)):
        load_dataset(path)
    ds = load_dataset(path, on_bad_image="skip")
    assert len(ds) == 1 and ds.skipped[0][0] == 2 and ds[0].images[0].getpixel((0, 0)) == RED


def test_unusual_modes_are_converted_not_rejected(tmp_path: Path) -> None:
    # Grey, grey+alpha, palette, CMYK and 16-bit grey all decode to RGB: such files are fine, not bad.
    records = []
    for i, mode in enumerate(["L", "LA", "P", "CMYK", "I;16"]):
        fmt = "JPEG" if mode == "CMYK" else "TIFF" if mode == "I;16" else "PNG"
        Image.new("RGB", (4, 4), (0, 0, 0)).convert(mode).save(tmp_path / f"{i}.img", format=fmt)
        records.append({"images": [f"{i}.img"], "prompt": "q", "answer": mode})
    ds = load_dataset(_jsonl(tmp_path / "modes.jsonl", records))
    assert [s.images[0].mode for s in ds] == ["RGB"] * 5
    assert ds[0].images[0].getpixel((0, 0)) == (0, 0, 0)


# --- An image that fails mid-run: skipped, counted, replaced; a resumed run goes on ---


def _colour_files(tmp_path: Path, n: int) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    records = []
    for i in range(n):
        (tmp_path / f"img/{i}.png").write_bytes(_encoded((i, 0, 0)))
        records.append({"id": f"r{i}", "images": [f"img/{i}.png"], "prompt": "q", "answer": "ab"[i % 2]})
    return _jsonl(tmp_path / "train.jsonl", records)


@pytest.mark.parametrize("balance_key", [None, "answer"])
def test_image_failing_mid_run_is_skipped_and_resume_goes_on(tmp_path: Path, balance_key: str | None) -> None:
    path = _colour_files(tmp_path, 8)
    # The red channel of record i's image is i, so each sample says which record it came from.
    reference = PromptSampler(load_dataset(path), 4, seed=5, balance_key=balance_key)
    expected = [i for _ in range(6) for i in reference.next_batch()]  # 24 draws = 3 epochs of 8

    ds = load_dataset(path)  # every image decodes at load
    sampler = PromptSampler(ds, 4, seed=5, balance_key=balance_key)
    first = draw_samples(ds, sampler)
    assert [s.images[0].getpixel((0, 0))[0] for s in first] == expected[:4]
    victim = expected[5]  # drawn in the next batch
    (tmp_path / f"img/{victim}.png").write_bytes(_noise("PNG")[:-100])  # the file breaks during the run
    second = draw_samples(ds, sampler)
    got = [s.images[0].getpixel((0, 0))[0] for s in second]
    assert len(got) == 4 and victim not in got and sampler.excluded == {victim}
    # Its slot is refilled in place from the same stream: the record the reference order draws next
    # (with balancing: the next one of the victim's answer, the stream it came from).
    slot = expected[4:8].index(victim)
    assert got[:slot] + got[slot + 1 :] == [i for i in expected[4:8] if i != victim]
    if balance_key is None:
        assert got[slot] == expected[8]
    else:
        assert got[slot] % 2 == victim % 2
    state = json.loads(json.dumps(sampler.state_dict()))

    # Resume: the load-time decode now finds the broken file; under `skip` the record is dropped and the
    # saved data position still applies (the sampler's streams run over every row of the file).
    resumed_ds = load_dataset(path, on_bad_image="skip")
    assert resumed_ds.num_skipped == 1 and len(resumed_ds) == 7
    resumed = PromptSampler(resumed_ds, 4, seed=5, balance_key=balance_key)
    resumed.load_state_dict(state)
    interrupted = PromptSampler(ds, 4, seed=5, balance_key=balance_key)  # the run that kept going
    interrupted.load_state_dict(state)
    interrupted.excluded.add(victim)
    after = [resumed_ds.ids[i] for i in resumed.next_batch()]
    assert after == [ds.ids[i] for i in interrupted.next_batch()] and f"r{victim}" not in after


def test_every_record_bad_mid_run_is_a_clear_error(tmp_path: Path) -> None:
    path = _colour_files(tmp_path, 2)
    ds = load_dataset(path)
    sampler = PromptSampler(ds, 2, seed=0)
    for i in range(2):
        (tmp_path / f"img/{i}.png").write_bytes(b"")
    with pytest.raises(DatasetError, match="every record has a bad image, so no prompt can be drawn"):
        draw_samples(ds, sampler)
