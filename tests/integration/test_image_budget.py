"""The image budget end to end with the real parts: a 4000 x 3000 photo has the same image-token count in the
learner, the vLLM engine (CPU build) and the vLLM server started from the trained adapter's manifest; training
steps run on such photos; records that cannot fit are dropped at load and prompts the engine rejects are
skipped, not the batch."""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw

from visionrl.config import JobConfig, config_from_dict
from visionrl.data.images import ImageBudget, fit_image
from visionrl.data.lengths import prompt_lengths
from visionrl.data.prompts import build_prompt
from visionrl.types import PromptItem, SamplingSpec

pytestmark = pytest.mark.slow

PHOTO = (4000, 3000)
# max_pixels 500,000 (not the default, so a server that ignored the manifest would count differently): 4000 x 3000
# rounds to 4000 x 3008 = 12,032,000 px > 500,000, beta = sqrt(12,000,000 / 500,000) = 4.899; width
# floor(4000 / 4.899 / 32) = floor(25.52) = 25 cells, height floor(3000 / 4.899 / 32) = floor(19.14) = 19 cells:
# 800 x 608 px, 25 * 19 = 475 image tokens. The tiny processor's own bound (448 x 448) would give 16 * 12 = 192.
MAX_PIXELS = 500_000
PHOTO_TOKENS = 475
MAX_MODEL_LEN = 768  # one photo (~490 tokens) fits; two (~970) do not
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
QUESTION = "What color is the shape?"


def _picture(size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    w, h = size
    ImageDraw.Draw(image).rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=colour)
    return image


@pytest.fixture(scope="module")
def photo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 photos and 4 small pictures (one colour each), a record of two photos (too long for MAX_MODEL_LEN)
    and one of five pictures (over max_images_per_prompt 4)."""
    out = tmp_path_factory.mktemp("photos")
    records: list[dict[str, Any]] = []
    for colour, rgb in COLOURS.items():
        for kind, size in (("photo", PHOTO), ("small", (64, 64))):
            _picture(size, rgb).save(out / f"{kind}-{colour}.png")
            records.append({"id": f"{kind}-{colour}", "images": [f"{kind}-{colour}.png"], "prompt": QUESTION,
                            "answer": colour})  # fmt: skip
    records.append({"id": "two-photos", "images": ["photo-red.png", "photo-blue.png"], "prompt": QUESTION,
                    "answer": "red"})  # fmt: skip
    records.append({"id": "five", "images": ["small-red.png"] * 5, "prompt": QUESTION, "answer": "red"})
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def _cfg(model: Path, data: Path, out: Path, **rollout: Any) -> JobConfig:
    return config_from_dict(
        {
            "output_dir": str(out),
            "model": {"path": str(model), "dtype": "float32"},
            "data": {"train": str(data / "train.jsonl"), "max_pixels": MAX_PIXELS},
            "rewards": [{"name": "exact_match", "kwargs": {"first_word": True}}],
            "lora": {"rank": 8, "alpha": 16, "train_merger": True},
            "algorithm": {"group_size": 2},
            "rollout": {
                "prompts_per_step": 4,
                "max_new_tokens": 2,
                "max_model_len": MAX_MODEL_LEN,
                **rollout,
            },
            "train": {"lr": 1e-3, "steps": 1, "torch_threads": 1, "micro_batch_tokens": 4096},
            "logging": {"eval_every": 100, "save_every": 100, "images_every": 100},
            "ray": {"num_cpus": 2},
        }
    )


def test_learner_and_vllm_count_the_same_image_tokens_and_rejected_prompts_are_skipped(
    tiny_model: Path, photo_data: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm import SamplingParams

    from visionrl.models.sequences import Sequence
    from visionrl.orchestrate.prompt_stream import PromptStream
    from visionrl.rollout.vllm_engine import VLLMEngine
    from visionrl.train.learner import Learner, TrainBatch

    cfg = _cfg(tiny_model, photo_data, tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="visionrl.data.lengths"):
        stream = PromptStream(cfg)
    assert sorted(stream.train.ids) == sorted(f"{k}-{c}" for c in COLOURS for k in ("photo", "small"))
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert (
        "dropped 1 record(s) with more than data.max_images_per_prompt=4 images" in logged
        and "ids: five" in logged
    )
    assert "ids: two-photos" in logged

    index = stream.train.ids.index("photo-red")
    photo = build_prompt(stream.train[index], stream.processor)
    assert photo.images[0].size == (800, 608)  # resized once, into the budget, before any processor sees it
    learner = Learner(cfg, device="cpu")
    encoded = learner.encode_prompts([photo])[0]
    learner_tokens = len(encoded.input_ids)
    assert int((encoded.mm_token_type_ids == 1).sum()) == PHOTO_TOKENS
    assert prompt_lengths(stream.train, stream.processor, ImageBudget.of(cfg.data))[index] == learner_tokens

    engine = VLLMEngine(str(tiny_model), lora_rank=8, tower_lora=True, forbidden_token_ids=learner.forbidden.tolist(),
                        dtype="float32", max_model_len=MAX_MODEL_LEN, budget=ImageBudget.of(cfg.data))  # fmt: skip
    try:
        # The engine's own view of the prompt: its token ids after vLLM's processor expanded the image.
        raw = {"prompt": photo.text, "multi_modal_data": {"image": photo.images}}
        out = engine._llm.generate([raw], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert len(out.prompt_token_ids) == learner_tokens
        assert list(out.prompt_token_ids) == encoded.input_ids.tolist()

        engine.load_adapter(learner.adapter_payload())
        small = build_prompt(stream.train[stream.train.ids.index("small-blue")], stream.processor)
        two = PromptItem(photo.text.replace("<|image_pad|>", "<|image_pad|><|vision_end|><|vision_start|><|image_pad|>", 1),
                         photo.images * 2, sample_id="two-photos")  # fmt: skip
        five = PromptItem(small.text.replace("<|image_pad|>", "<|image_pad|>" * 5, 1), small.images * 5,
                          sample_id="five")  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="visionrl.rollout.vllm_engine"):
            groups = engine.generate([photo, two, five, small], SamplingSpec(n=2, max_tokens=2))
        assert [len(g) for g in groups] == [2, 0, 0, 2]  # the two rejected prompts only, not the batch
        assert [g[0].prompt_index for g in groups if g] == [0, 3]
        rejected = [r.getMessage() for r in caplog.records if "vLLM rejected prompt" in r.getMessage()]
        assert len(rejected) == 2 and "'two-photos'" in rejected[0] and "'five'" in rejected[1]
        # The learner scores the engine's photo completions like the engine did: same pixels, same tokens.
        seqs = [Sequence(0, c.token_ids, 0.0, c.logprobs) for c in groups[0]]
        ours = learner.logprobs(TrainBatch([photo], seqs))
        diffs = [
            abs(a - b)
            for s, row in zip(seqs, ours, strict=True)
            for a, b in zip(row, s.sampling_logprobs, strict=True)
        ]
        assert diffs and max(diffs) < 1e-3
        assert len(engine.generate([photo], SamplingSpec(n=1, max_tokens=2))[0]) == 1  # still serving
    finally:
        engine.close()


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _prompt_tokens(client: Any, model: str, images: list[Image.Image]) -> int:
    content = [{"type": "image_url", "image_url": {"url": _data_url(im)}} for im in images]
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}],
        max_tokens=1, temperature=0.0,
    )  # fmt: skip
    return int(response.usage.prompt_tokens)


def test_training_runs_on_photos_and_the_served_model_counts_the_same_tokens(
    tiny_model: Path, photo_data: Path, tmp_path: Path
) -> None:
    import openai

    from visionrl import metrics as tags
    from visionrl.adapter.export import export_adapter
    from visionrl.models.loader import load_processor
    from visionrl.orchestrate.loop import train
    from visionrl.serve.server import start_server

    # the HF engine: vLLM's view of the photo is checked above, the served model's below
    cfg = _cfg(tiny_model, photo_data, tmp_path / "run", engine="hf")
    result = train(cfg)
    assert result.steps == 1 and all(h[tags.SKIPPED_PROMPTS] == 0 for h in result.history)
    assert all(h[tags.LOSS_POLICY] == h[tags.LOSS_POLICY] for h in result.history)  # finite, not NaN
    budget = {"min_pixels": 1024, "max_pixels": MAX_PIXELS, "max_images_per_prompt": 4}
    assert json.loads((result.adapter_dir / "visionrl_manifest.json").read_text())["images"] == budget
    export_adapter(tmp_path / "run", tmp_path / "export")

    processor = load_processor(tiny_model, ImageBudget.of(cfg.data))
    photo = Image.open(photo_data / "photo-green.png").convert("RGB")
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    local = len(processor(text=[text], images=[photo], return_tensors="pt")["input_ids"][0])
    with start_server(str(tiny_model), {"photo": str(tmp_path / "export")}, cache_dir=tmp_path / "cache",
                      log_path=tmp_path / "server.log") as server:  # fmt: skip
        assert json.loads(server.command[server.command.index("--mm-processor-kwargs") + 1])["size"] == {
            "shortest_edge": 1024, "longest_edge": MAX_PIXELS
        }  # fmt: skip
        client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
        try:
            # As the endpoint client sends it (resized into the budget), and the photo as it is: the server
            # applies the same budget itself.
            assert _prompt_tokens(client, "photo", [fit_image(photo, ImageBudget.of(cfg.data), 32)]) == local
            assert _prompt_tokens(client, "photo", [photo]) == local
            with pytest.raises(openai.BadRequestError, match="At most 4 image"):
                _prompt_tokens(client, "photo", [photo.resize((64, 64))] * 5)
        finally:
            client.close()


def test_the_hf_engine_applies_the_budget_and_skips_a_prompt_over_the_image_limit(
    tiny_model: Path, photo_data: Path
) -> None:
    from visionrl.config import LoraConfig
    from visionrl.data import load_dataset
    from visionrl.rollout.hf_engine import HFEngine

    budget = ImageBudget(max_pixels=MAX_PIXELS, max_images=1)
    engine = HFEngine(str(tiny_model), lora=LoraConfig(rank=8), forbidden_token_ids=[], dtype="float32",
                      device="cpu", budget=budget)  # fmt: skip
    try:
        ds = load_dataset(photo_data / "train.jsonl")
        photo = build_prompt(ds[ds.ids.index("photo-red")], engine.processor)
        two = build_prompt(ds[ds.ids.index("two-photos")], engine.processor)
        enc = engine.processor(text=[photo.text], images=photo.images, return_tensors="pt")
        assert int((enc["mm_token_type_ids"] == 1).sum()) == PHOTO_TOKENS
        groups = engine.generate([photo, two, photo], SamplingSpec(n=2, max_tokens=2, seed=0))
        assert [len(g) for g in groups] == [2, 0, 2]  # two images, over max_images=1: that prompt only
        assert [c.prompt_index for g in groups for c in g] == [0, 0, 2, 2]
    finally:
        engine.close()
